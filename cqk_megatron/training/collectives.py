"""The training package's own collectives, in one module.

The loop, the engines, preemption, evaluation and checkpointing call ``torch.distributed``
only through these functions (``tests/test_device.py`` checks the source for it, and audits
a real two-rank run); Megatron-Core and DeepSpeed run their own collectives inside.

**One collective library per device, every collective tensor on ``device()``.** The default process
group is NCCL on GPU and gloo on CPU (``cqk_megatron.parallel.process_groups``), and every
tensor these functions reduce lives on ``cqk_megatron.parallel.device.device()``; each
function checks that and names the fix. We considered the alternative that torchtitan
offers, a default group on both libraries (``cpu:gloo,cuda:nccl``), and chose against it:

- torchtitan adds gloo for CPU tensors only for FSDP's CPU offload (``enable_cpu_backend``),
  and Megatron-LM keeps an NCCL default group too, creating gloo subgroups of its own where
  it needs CPU collectives (``parallel_state`` does that for the distributed optimizer's
  checkpoint format, which therefore needs nothing from the default group);
- a second library on the default group is inherited by every subgroup Megatron creates:
  another TCP rendezvous and another set of gloo connections per group at start-up, on
  thousands of ranks, for a handful of scalars per step;
- a CPU tensor silently taking the gloo route costs a device sync and a host round trip
  where the value was just computed on the GPU (a loss sum), and it hides the very mistake
  (a tensor made without ``device=``) that an NCCL-only group reports at once (a group
  created as ``cuda:gloo`` reproduces that refusal on CPU: ``tests/test_device.py``).

So the few scalars the loop reduces (the loss, the stop flag, the parameter count) are
made on the device; the price is one small GPU kernel each, next to a step's thousands.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from cqk_megatron.parallel.device import device

# The torch.distributed functions that communicate; tests/test_device.py refuses any call
# of them outside this module (and the model's own gradient hooks, attention/tp_grads.py).
COMMUNICATING = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "irecv",
        "isend",
        "monitored_barrier",
        "recv",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
    }
)

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class CollectiveDeviceError(RuntimeError):
    """A tensor handed to a collective is not on this rank's device."""


def _require_on_device(tensor: torch.Tensor, what: str) -> None:
    here = device()
    if tensor.device != here:
        raise CollectiveDeviceError(
            f"{what}: got a tensor on {tensor.device}, but this rank's collectives run on "
            f"{here} (an nccl group refuses CPU tensors); create it with "
            "device=cqk_megatron.parallel.device.device()"
        )


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` (None: the world); returns it."""
    _require_on_device(tensor, f"all_reduce({op})")
    dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``tensor`` (the same shape on each) stacked in ``group``'s rank order:
    a new first dimension of the group's size."""
    _require_on_device(tensor, "all_gather")
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    return torch.stack(gathered)


def sum_numbers(values: Sequence[float], group=None) -> list[float]:
    """The sums over ``group`` of a few numbers (fp64 on the device: exact for integers
    below 2**53, such as parameter counts)."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device())
    return all_reduce(tensor, "sum", group).tolist()


def any_rank(flag: bool, group=None) -> bool:
    """True on every rank of ``group`` if it is true on any."""
    tensor = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32, device=device())
    return bool(all_reduce(tensor, "max", group).item())


def barrier(group=None) -> None:
    """Wait for every rank of ``group``; on GPU on this rank's device (NCCL would
    otherwise guess one, with a warning)."""
    here = device()
    if here.type == "cuda":
        dist.barrier(group=group, device_ids=[here.index])
    else:
        dist.barrier(group=group)


def gather_objects(value, group=None) -> list:
    """Every rank's picklable ``value``, in rank order (on GPU, torch stages the pickles on
    this rank's bound device): how the ranks agree on a failure's message before all of
    them raise it (``training/checkpoint.py``)."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def from_rank0(value, group=None):
    """Rank 0's picklable ``value`` on every rank of ``group`` (a decision rank 0 made
    once: where the run starts, or why it refuses to)."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather_objects_on_rank0(value, group=None) -> list | None:
    """Every rank's picklable ``value``, in rank order, on the first rank of ``group`` (None
    on the others): what only rank 0 needs, such as each rank's digests of the checkpoint
    files it wrote, for the one manifest rank 0 writes."""
    first = 0 if group is None else dist.get_global_rank(group, 0)
    on_first = dist.get_rank() == first
    gathered = [None] * dist.get_world_size(group) if on_first else None
    dist.gather_object(value, gathered, dst=first, group=group)
    return gathered
