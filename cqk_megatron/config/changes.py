"""What differs between two run configs, and which differences matter for a checkpoint.

A checkpoint records the config it was saved with (``iter_*/config.yaml``), and a run
folder its last started config (``config.yaml``). Resuming, ``train.init_from``,
``cqk convert export`` and the launcher's pre-flight compare them with the config in
hand: a change of a *shape* key makes the weights of one unloadable into the other; a
change of a *schedule* key changes the learning rate from the resume step on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cqk_megatron.config import RunConfig, to_dict
from cqk_megatron.config.schema import flatten

# Keys that decide the shapes of the model's parameters (the parallel layout does not:
# checkpoints are resharded on load).
SHAPE_KEYS = (
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.num_query_groups",
    "model.ffn_hidden_size",
    "model.vocab_size",
    "model.make_vocab_size_divisible_by",
    "model.normalization",
    "model.swiglu",
    "model.tie_embeddings",
    "attention.coupling",
    "attention.scoring",
    "attention.coupling_hidden",
    "attention.invertible_layers",
)
# Keys of ``cqk_megatron.training.lr_schedule.learning_rate``.
SCHEDULE_KEYS = (
    "train.train_steps",
    "train.lr",
    "train.min_lr",
    "train.lr_schedule",
    "train.warmup_steps",
    "train.wsd_decay_fraction",
)
# Where a run folder is, not what it trains.
LOCATION_KEYS = ("name", "log.root")


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {self.old!r} -> {self.new!r}"


def changes(old: RunConfig, new: RunConfig, keys: tuple[str, ...] | None = None) -> list[Change]:
    """Every key whose value differs (only ``keys`` if given), in a stable order."""
    a, b = flatten(to_dict(old)), flatten(to_dict(new))
    names = keys if keys is not None else tuple(sorted(set(a) | set(b)))
    return [Change(k, a.get(k), b.get(k)) for k in names if a.get(k) != b.get(k)]


def shape_changes(old: RunConfig, new: RunConfig) -> list[Change]:
    return changes(old, new, SHAPE_KEYS)


def schedule_changes(old: RunConfig, new: RunConfig) -> list[Change]:
    return changes(old, new, SCHEDULE_KEYS)


def listed(found: list[Change], limit: int = 8) -> str:
    text = ", ".join(str(c) for c in found[:limit])
    return text + (f" and {len(found) - limit} more" if len(found) > limit else "")


def shape_mismatch_message(saved: str, found: list[Change], fix: str) -> str:
    """One line: the model of ``saved`` differs in ``found``, and what to do."""
    fields = ", ".join(f"{c.key}={c.old!r} (this config: {c.new!r})" for c in found)
    return f"{saved} holds a model of another shape: {fields}; {fix}"
