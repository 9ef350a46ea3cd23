"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

A drop-in for Megatron's ``DotProductAttention`` (same constructor and call): it runs on
CPU, and on GPU lets PyTorch pick the flash / cuDNN / memory-efficient kernel. Grouped
query attention goes to SDPA as is (``enable_gqa``), with no copy of keys and values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

# torch.nn.attention.SDPBackend's values, as torch._fused_sdp_choice returns them
SDPA_KERNELS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def chosen_sdpa_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> str:
    """The kernel ``scaled_dot_product_attention`` would run for these tensors (causal
    unless ``mask``): flash, cudnn, efficient or math.

    Asks PyTorch's own dispatcher (``_fused_sdp_choice``, the gate every SDPA call goes
    through, on CPU and CUDA), so the answer follows the installed version's rules, the
    enabled kernels and their priority order. On CUDA, give tensors that require grad
    to include the backward's constraints.
    """
    choice = torch._fused_sdp_choice(
        q, k, v, mask, dropout_p, mask is None, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return SDPA_KERNELS.get(int(choice), f"kernel {int(choice)}")


class SDPACoreAttention(MegatronModule):
    """``[s, b, heads, d]`` query/key/value -> ``[s, b, heads * d]`` context."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("SDPACoreAttention does not support context parallelism")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.tp_group = pg_collection.tp
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.head_dim = divide(
            config.kv_channels * config.num_attention_heads, config.num_attention_heads
        )
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1 / math.sqrt(self.head_dim)
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    @classmethod
    def spec_params(cls, attention, transformer_impl: str) -> dict:
        """Constructor options this scoring takes from ``attention`` and ``transformer_impl``."""
        return {}

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Softmax attention in SDPA layout ``[b, heads, s, d]`` (causal unless masked)."""
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=mask is None,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )

    def sdpa_mask(
        self, attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None
    ) -> torch.Tensor | None:
        """SDPA's boolean mask (True = attend), or None for the causal kernel path."""
        mask_type = attn_mask_type or self.attn_mask_type
        if mask_type == AttnMaskType.causal:
            return None
        if attention_mask is None:
            raise ValueError(f"attention mask type {mask_type} needs an attention_mask")
        return ~attention_mask.bool()  # Megatron masks mark positions to drop

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("packed sequences and attention bias are not supported")
        mask = self.sdpa_mask(attention_mask, attn_mask_type)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        context = self.score(q, k, v, mask)
        seq, batch = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def score(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The scoring rule: ``[b, h, s, d]`` in, ``[b, h', s, d']`` out (h' d' = h d)."""
        return self.attend(q, k, v, mask)
