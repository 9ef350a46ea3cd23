"""The ``ModuleSpec`` of a GPT layer for any attention variant.

A layer's attention has two orthogonal choices: the **coupling** applied to (q, k)
before scoring, and the **scoring**. Each is one registered object of
``cqk_megatron.variants`` (its module class and the options it takes), and a named
variant is a preset of the pair: a new coupling or scoring is one class and one
registration, never a factory per pair. Everything else in the layer is Megatron's own local
spec (or its Transformer Engine spec on GPU, where TE is installed), except that the local
spec's norms are ``norm.TorchNorm``, which also runs under sequence parallelism.
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from cqk_megatron.config import AttentionConfig, RunConfig
from cqk_megatron.model.attention import QKSelfAttention, QKSelfAttentionSubmodules
from cqk_megatron.model.norm import TorchNorm
from cqk_megatron.variants import coupling, scoring


def coupling_spec(attention: AttentionConfig, head_dim: int) -> ModuleSpec | None:
    """The coupling submodule spec, or None for a coupling without a module (``none``)."""
    variant = coupling(attention.coupling)
    module = variant.module_class()
    if module is None:
        return None
    return ModuleSpec(module=module, params=variant.constructor_options(attention, head_dim))


def _base_layer_spec(normalization: str, transformer_impl: str) -> ModuleSpec:
    if transformer_impl == "transformer_engine":
        try:
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )

            return get_gpt_layer_with_transformer_engine_spec()
        except (ImportError, AssertionError) as error:
            raise RuntimeError(
                "transformer_impl=transformer_engine needs Transformer Engine installed; "
                "set transformer_impl=local or install transformer-engine"
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
    transformer_impl: str = "local",
) -> ModuleSpec:
    """Megatron's GPT layer spec with our self-attention: coupling x scoring."""
    layer = _base_layer_spec(normalization, transformer_impl)
    self_attention = layer.submodules.self_attention
    base = self_attention.submodules
    submodules = QKSelfAttentionSubmodules(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
        coupling=coupling_spec(attention, head_dim),
    )
    core_attention = scoring(attention.scoring).core_attention_class()
    submodules.core_attention = ModuleSpec(
        module=core_attention, params=core_attention.spec_params(attention, transformer_impl)
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


def layer_spec_from_config(config: RunConfig) -> ModuleSpec:
    return gpt_layer_spec(
        config.attention,
        config.model.head_dim,
        normalization=config.model.normalization,
        transformer_impl=config.transformer_impl,
    )
