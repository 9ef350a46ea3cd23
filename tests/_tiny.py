"""The tests' tiny model: one builder, its shape as parameters.

Each test file states only how its model differs (a wider vocabulary, fp64, GQA, a longer
sequence); ``None`` leaves a field at the config's default.
"""

from __future__ import annotations

from cqk_megatron.config import RunConfig, load_config
from cqk_megatron.variants import pair


def variant_overrides(variant: str) -> list[str]:
    """The attention of ``variant``: a preset name (``VARIANTS``) or ``coupling+scoring``
    (names checked by ``validate``, so that a test can build a refused pair)."""
    coupling, scoring = variant.split("+", 1) if "+" in variant else pair(variant)
    return [f"attention.coupling={coupling}", f"attention.scoring={scoring}"]


def tiny_shape(
    *,
    vocab: int = 128,
    layers: int = 2,
    hidden: int = 64,
    heads: int | None = 8,
    kv_heads: int | None = 4,
    seq: int = 12,
    precision: str | None = None,
) -> list[str]:
    """The model's shape (and ``train.precision``) as overrides."""
    fields = {
        "model.vocab_size": vocab,
        "model.num_layers": layers,
        "model.hidden_size": hidden,
        "model.num_attention_heads": heads,
        "model.num_query_groups": kv_heads,
        "model.seq_length": seq,
        "train.precision": precision,
    }
    return [f"{key}={value}" for key, value in fields.items() if value is not None]


def tiny_overrides(variant: str = "standard", **shape) -> list[str]:
    return [*variant_overrides(variant), *tiny_shape(**shape)]


def tiny_config(variant: str = "standard", *overrides: str, **shape) -> RunConfig:
    """The tiny model of ``variant``, ``overrides`` applied last."""
    return load_config(None, [*tiny_overrides(variant, **shape), *overrides])
