"""Megatron-Core attention modules: SDPA core attention, differential scoring, and
self-attention with a (q, k) coupling."""

from cqk_megatron.model.attention.coupled import QKSelfAttention, QKSelfAttentionSubmodules
from cqk_megatron.model.attention.differential import DifferentialCoreAttention
from cqk_megatron.model.attention.sdpa import SDPACoreAttention

__all__ = [
    "DifferentialCoreAttention",
    "QKSelfAttention",
    "QKSelfAttentionSubmodules",
    "SDPACoreAttention",
]
