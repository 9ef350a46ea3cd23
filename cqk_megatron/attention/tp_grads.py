"""Gradients of parameters that are replicated across tensor-parallel ranks but see
different heads on each rank.

The coupling MLP ``f``, ``dt``, the differential ``lambda`` vectors and its RMSNorm are
whole on every tensor-parallel rank, yet each rank applies them to its own slice of the
heads, so each rank's gradient is a partial sum. A tensor hook adds the partial sums
across the tensor-parallel group as soon as autograd has them, before any engine
(DeepSpeed ZeRO's reduce hooks, Megatron's grad buffers) accumulates them: a TP=2 run
then gets exactly TP=1's gradient whatever engine drives it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def sum_partial_grads_across_tp(module: nn.Module, tp_group: dist.ProcessGroup | None) -> None:
    """Make every parameter of ``module`` receive the sum of its TP ranks' gradients."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return

    def all_reduce(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=tp_group)
        return grad

    for parameter in module.parameters():
        parameter.register_hook(all_reduce)
        # Read by checkpoint and engine code: the value is replicated, the grad is summed.
        parameter.cqk_tp_partial_grad = True
