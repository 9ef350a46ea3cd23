"""``ModuleSpec`` factories for every attention variant.

A layer's attention has two orthogonal choices: the **coupling** applied to (q, k)
before scoring, and the **scoring**. Each is one table entry here (a class), and a
named variant is a preset of the pair: a new coupling or scoring is one class and one
line, never a factory per pair. Everything else in the layer is Megatron's own local
spec (or its Transformer Engine spec on GPU, where TE is installed), except that the local
spec's norms are ``norm.TorchNorm``, which also runs under sequence parallelism.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from cqk_megatron.attention import (
    DifferentialCoreAttention,
    QKSelfAttention,
    QKSelfAttentionSubmodules,
    SDPACoreAttention,
)
from cqk_megatron.config import VARIANTS, AttentionConfig, RunConfig
from cqk_megatron.coupling import COUPLING_CLASSES
from cqk_megatron.norm import TorchNorm

SCORING_CLASSES: dict[str, type] = {
    "standard": SDPACoreAttention,
    "differential": DifferentialCoreAttention,
}


def _integrator_options(attention: AttentionConfig) -> dict:
    return {"steps": attention.steps, "dt_init": attention.dt_init}


def _invertible_options(attention: AttentionConfig) -> dict:
    return {"layers": attention.invertible_layers, "scale_bound": attention.invertible_scale_bound}


# Which of the attention options each coupling class takes (besides head_dim and hidden).
COUPLING_OPTIONS: dict[str, Callable[[AttentionConfig], dict]] = {
    "euler": _integrator_options,
    "hamiltonian": _integrator_options,
    "mlp_only": _integrator_options,
    "invertible": _invertible_options,
}


def coupling_spec(attention: AttentionConfig, head_dim: int) -> ModuleSpec | None:
    """The coupling submodule spec, or None for ``coupling: none``."""
    module = COUPLING_CLASSES[attention.coupling]
    if module is None:
        return None
    hidden = attention.coupling_hidden or head_dim
    params = {"hidden": hidden, **COUPLING_OPTIONS[attention.coupling](attention)}
    return ModuleSpec(module=module, params=params)


def _base_layer_spec(normalization: str, backend: str) -> ModuleSpec:
    if backend == "transformer_engine":
        try:
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )

            return get_gpt_layer_with_transformer_engine_spec()
        except (ImportError, AssertionError) as error:
            raise RuntimeError(
                "backend=transformer_engine needs Transformer Engine installed; "
                "set backend=local or install transformer-engine"
            ) from error
    layer = get_gpt_layer_local_spec(normalization=normalization)
    # Megatron's choice here is Apex's FusedLayerNorm where installed, else WrappedTorchNorm,
    # which refuses sequence parallelism: one norm everywhere, that accepts it.
    return dataclasses.replace(
        layer,
        submodules=dataclasses.replace(
            layer.submodules, input_layernorm=TorchNorm, pre_mlp_layernorm=TorchNorm
        ),
    )


def gpt_layer_spec(
    attention: AttentionConfig,
    head_dim: int,
    normalization: str = "RMSNorm",
    backend: str = "local",
) -> ModuleSpec:
    """Megatron's GPT layer spec with our self-attention: coupling x scoring."""
    layer = _base_layer_spec(normalization, backend)
    self_attention = layer.submodules.self_attention
    base = self_attention.submodules
    submodules = QKSelfAttentionSubmodules(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
        coupling=coupling_spec(attention, head_dim),
    )
    scoring = SCORING_CLASSES[attention.scoring]
    submodules.core_attention = ModuleSpec(
        module=scoring, params=scoring.spec_params(attention, backend)
    )
    attention_spec = ModuleSpec(
        module=QKSelfAttention,
        params={
            **self_attention.params,
            "coupling_position": attention.position,
            "coupling_impl": attention.coupling_impl,
            "recompute_coupling": attention.recompute_coupling,
        },
        submodules=submodules,
    )
    return dataclasses.replace(
        layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention_spec)
    )


def variant_attention(variant: str, **options) -> AttentionConfig:
    """The ``AttentionConfig`` of a named variant (see ``config.VARIANTS``)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {list(VARIANTS)}")
    coupling, scoring = VARIANTS[variant]
    return AttentionConfig(coupling=coupling, scoring=scoring, **options)


# One factory per named variant; each is a preset of gpt_layer_spec's two choices.


def standard_layer_spec(head_dim: int, **kwargs) -> ModuleSpec:
    return gpt_layer_spec(variant_attention("standard"), head_dim, **kwargs)


def coupled_layer_spec(
    head_dim: int, integrator: str = "hamiltonian", steps: int = 1, **kwargs
) -> ModuleSpec:
    attention = AttentionConfig(coupling=integrator, steps=steps)
    return gpt_layer_spec(attention, head_dim, **kwargs)


def mlp_only_layer_spec(head_dim: int, steps: int = 1, **kwargs) -> ModuleSpec:
    return gpt_layer_spec(variant_attention("mlp_only", steps=steps), head_dim, **kwargs)


def invertible_layer_spec(head_dim: int, layers: int = 2, **kwargs) -> ModuleSpec:
    attention = variant_attention("invertible", invertible_layers=layers)
    return gpt_layer_spec(attention, head_dim, **kwargs)


def differential_layer_spec(head_dim: int, **kwargs) -> ModuleSpec:
    return gpt_layer_spec(variant_attention("differential"), head_dim, **kwargs)


def coupled_differential_layer_spec(
    head_dim: int, integrator: str = "hamiltonian", steps: int = 1, **kwargs
) -> ModuleSpec:
    attention = AttentionConfig(coupling=integrator, scoring="differential", steps=steps)
    return gpt_layer_spec(attention, head_dim, **kwargs)


def layer_spec_from_config(config: RunConfig) -> ModuleSpec:
    return gpt_layer_spec(
        config.attention,
        config.model.head_dim,
        normalization=config.model.normalization,
        backend=config.backend,
    )
