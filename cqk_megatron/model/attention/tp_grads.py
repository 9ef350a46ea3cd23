"""Gradients of parameters that are replicated across tensor-parallel ranks but see
different heads on each rank.

The coupling MLP ``f``, ``dt``, the differential ``lambda`` vectors and its RMSNorm are
whole on every tensor-parallel rank, yet each rank applies them to its own slice of the
heads, so each rank's gradient is a partial sum. A tensor hook adds the partial sums
across the tensor-parallel group as soon as autograd has them, before any engine
(DeepSpeed ZeRO's reduce hooks, Megatron's grad buffers) accumulates them: a TP=2 run
then gets exactly TP=1's gradient whatever engine drives it.

The same hook serves the DeepSpeed engine for the parameters that Megatron leaves to its
``finalize_model_grads`` under sequence parallelism (``left_to_finalize_model_grads``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


def sum_partial_grads_across_tp(module: nn.Module, tp_group: dist.ProcessGroup | None) -> None:
    """Make every parameter of ``module`` receive the sum of its TP ranks' gradients."""
    sum_grads_across_tp(module.parameters(), tp_group)


def sum_grads_across_tp(
    parameters: Iterable[nn.Parameter], tp_group: dist.ProcessGroup | None
) -> None:
    """Make each of ``parameters`` receive the sum of its TP ranks' gradients."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return

    def all_reduce(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=tp_group)
        return grad

    for parameter in parameters:
        parameter.register_hook(all_reduce)
        # Read by checkpoint and engine code: the value is replicated, the grad is summed.
        parameter.cqk_tp_partial_grad = True


def left_to_finalize_model_grads(model: nn.Module, sequence_parallel: bool) -> list[nn.Parameter]:
    """The parameters whose TP partial gradients Megatron leaves for its
    ``finalize_model_grads`` to sum, and that no hook here sums already.

    Under sequence parallelism each TP rank holds a slice of the sequence, so a parameter
    applied after the slicing, yet whole on every rank, gets a partial gradient on each. Megatron
    marks those ``sequence_parallel`` (the row-parallel linear layers' biases:
    ``linear_proj.bias`` and ``linear_fc2.bias`` in the GPT-2 family; Transformer Engine's and
    Apex's norms) and sums them in ``finalize_model_grads``, which only the Megatron engine
    calls. Our own norms (``norm.TorchNorm``) and ``f``, ``dt``, ``lambda`` are summed here
    already, and are not marked. Megatron's ``qk_layernorm`` (also summed there) is not
    used by this package's models.
    """
    if not sequence_parallel:
        return []
    return [
        param
        for param in model.parameters()
        if getattr(param, "sequence_parallel", False)
        and not getattr(param, "cqk_tp_partial_grad", False)
    ]
