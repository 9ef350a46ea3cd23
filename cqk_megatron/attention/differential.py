"""Differential Attention (Ye et al., 2024) as a Megatron core attention.

Only the scoring changes: the projections keep the baseline's shapes, heads pair up
inside each tensor-parallel rank (so heads per rank must be even), and the math is
``coupling.DifferentialScoring``, shared with the exported Hugging Face model.
"""

from __future__ import annotations

import torch

from cqk_megatron.attention.sdpa import SDPACoreAttention
from cqk_megatron.attention.tp_grads import sum_partial_grads_across_tp
from cqk_megatron.coupling import DifferentialScoring


class DifferentialCoreAttention(SDPACoreAttention):
    def __init__(self, config, layer_number, attn_mask_type, *args, **kwargs) -> None:
        super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
        self.differential = DifferentialScoring(
            self.head_dim, layer_index=self.layer_number - 1, eps=config.layernorm_epsilon
        ).to(dtype=config.params_dtype)
        # lambda and subln are whole on every TP rank but each rank uses them on its heads
        sum_partial_grads_across_tp(self.differential, self.tp_group)

    def score(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        return self.differential(q, k, v, lambda q_, k_, v_: self.attend(q_, k_, v_, mask))
