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

A hook costs one blocking all-reduce per parameter per micro-batch, in the parameters'
dtype. Where an engine can do with one a step, it takes the hooks over
(``take_over_tp_sums``) and sums the gradients of all those parameters at once at the
step's end (``sum_accumulated_grads_across_tp``): DeepSpeed's ZeRO-1 and ZeRO-2
(``engines.deepspeed.when_to_sum_tp_grads``) on the gradients accumulated over the
micro-batches (ZeRO-1), or on this rank's partition of them after the data-parallel
reduction (ZeRO-2); the Megatron engine on the fp32 ``main_grad`` after its data-parallel
reduce-scatter (``engines.megatron.MegatronEngine.finalize``). The sum is linear, so summing
the micro-batches' sums equals summing each micro-batch's, and it commutes with the
data-parallel average. DeepSpeed's ZeRO-3 and CPU offload keep the hooks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


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
        # kept so that an engine summing once per step can take the hook over
        parameter.cqk_tp_sum_hook = parameter.register_hook(all_reduce)
        # Read by engine code: the value is replicated, the grad is summed.
        parameter.cqk_tp_partial_grad = True


def take_over_tp_sums(model: nn.Module, also: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Remove the per-micro-batch TP-sum hooks from ``model``'s parameters and return every
    parameter whose TP partial gradients the caller must now sum itself, once per step
    (``sum_accumulated_grads_across_tp``): the hooked ones and ``also`` (given without a
    hook). Idempotent: a parameter taken over stays marked ``cqk_tp_partial_grad``."""
    for parameter in also:
        parameter.cqk_tp_partial_grad = True
    taken = []
    for parameter in model.parameters():
        hook = getattr(parameter, "cqk_tp_sum_hook", None)
        if hook is not None:
            hook.remove()
            parameter.cqk_tp_sum_hook = None
        if getattr(parameter, "cqk_tp_partial_grad", False):
            taken.append(parameter)
    return taken


def sum_accumulated_grads_across_tp(
    grads: list[torch.Tensor], tp_group: dist.ProcessGroup | None
) -> None:
    """Sum ``grads`` in place across the TP group: one all-reduce of them all, flattened
    into one buffer (one per dtype, as Megatron's ``finalize_model_grads`` does for the
    same parameters). Every TP rank must pass the same shapes in the same order."""
    if not grads or tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same_dtype in by_dtype.values():
        flat = _flatten_dense_tensors(same_dtype)
        dist.all_reduce(flat, group=tp_group)
        summed = _unflatten_dense_tensors(flat, same_dtype)
        for grad, total in zip(same_dtype, summed, strict=True):
            grad.copy_(total)


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
