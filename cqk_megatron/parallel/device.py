"""This rank's device, and the one way a batch gets there.

Imports only torch. Every tensor the package makes outside the model for a collective or
an accumulation names ``device()``; every batch reaches a model through ``to_device``.
On a CPU run both are the identity; on a GPU run they are what an ``nccl`` process group
needs (it takes CUDA tensors only: a CPU tensor in a collective raises ``No backend type
associated with device type cpu``) and what a model on ``cuda:N`` needs.

The rank's GPU is ``LOCAL_RANK`` (torchrun; ``cqk_megatron.parallel.process_groups`` sets it from
``SLURM_LOCALID`` under srun/submitit) modulo the GPUs this process sees, so a job that
gives each task one GPU through ``CUDA_VISIBLE_DEVICES`` gets ``cuda:0`` on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

CPU = torch.device("cpu")


def local_rank(env: Mapping[str, str] | None = None) -> int:
    """The rank within its node, from the launcher's environment (0 if none says)."""
    env = os.environ if env is None else env
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = env.get(name, "")
        if value.strip():
            return int(value)
    return 0


def device() -> torch.device:
    """``cuda:<local rank mod visible GPUs>`` when CUDA is available, else ``cpu``."""
    if not torch.cuda.is_available():
        return CPU
    return torch.device("cuda", local_rank() % torch.cuda.device_count())


def bind() -> torch.device:
    """Make ``device()`` this process's current CUDA device (before any CUDA work: NCCL,
    Megatron's buffers and ``torch.cuda.*`` calls without a device use the current one)."""
    here = device()
    if here.type == "cuda":
        torch.cuda.set_device(here)
    return here


def to_device(batch):
    """``batch`` (a tensor, or a dict/list/tuple of them) on ``device()``.

    On GPU each tensor goes through pinned host memory with ``non_blocking=True``, so the
    copy overlaps the work already queued on the GPU; PyTorch's pinned-memory allocator
    keeps the host buffer alive until its copy has run. On CPU nothing is copied.
    """
    here = device()
    if here.type == "cpu":
        return batch
    return move(batch, here, pin=here.type == "cuda")


def move(value, here: torch.device, pin: bool):
    """``to_device``'s walk over a batch: tensors go to ``here`` (through pinned memory if
    ``pin``), containers are rebuilt, anything else is returned as is."""
    if isinstance(value, torch.Tensor):
        if value.device == here:
            return value
        if pin and value.device.type == "cpu" and not value.is_pinned():
            value = value.pin_memory()
        return value.to(here, non_blocking=pin)
    if isinstance(value, Mapping):
        return {key: move(item, here, pin) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(move(item, here, pin) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(move(item, here, pin) for item in value)
    return value
