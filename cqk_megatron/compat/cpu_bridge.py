"""Megatron-Core 0.16's CUDA assumptions, redirected to CPU (each patch is listed, with
why and what would retire it, in ``compat.PATCHES``).

Megatron hard-codes CUDA in a few spots that matter on a CPU/gloo run:
``torch.cuda.current_device()`` for the p2p shape exchange and receive buffers, for the
RoPE frequencies and for the sequence-parallel gather buffers; ``torch.cuda.synchronize()``
after ``batch_isend_irecv``; and the schedules' token counter made with
``device="cuda"``; and the distributed checkpoint writer's synchronize and flag tensors.
Two tensor *methods* as well, while the Megatron function that calls them runs (see
``_tensor_method_users``): ``.type()`` names, and ``weight.data.cuda()`` when a tied
embedding's copy on the last pipeline stage is synchronised with the first stage's.
Activation recompute (``tensor_parallel.checkpoint``) saves and restores the CUDA generator
and Megatron's CUDA RNG tracker around each recomputed forward (see ``_RNG_BRIDGE``).
DeepSpeed's CPU accelerator, for its part, JIT-builds a shared-memory all-reduce op at every
start (see ``skip_deepspeed_shm_op``).
Instead of patching ``torch`` for everyone, each of those modules gets
its own view of ``torch`` in which these calls mean CPU; every other attribute is the
real ``torch``. Nothing changes when CUDA is
available. ``install()`` is idempotent; ``uninstall()`` restores the modules.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Callable

import torch

_PATCHED_MODULES = (
    "megatron.core.pipeline_parallel.p2p_communication",  # shape exchange, recv buffers
    "megatron.core.pipeline_parallel.schedules",  # token counter on "cuda"
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # inv_freq moved to GPU
    "megatron.core.tensor_parallel.mappings",  # sequence-parallel gather/scatter buffers
    "megatron.core.tensor_parallel.layers",  # sequence-parallel all-gather buffer
    "megatron.core.utils",  # the global memory buffer used by those gathers
    "megatron.core.dist_checkpointing.strategies.filesystem_async",  # synchronize on save
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # "cuda" flag tensors
    # Megatron's DDP and distributed optimizer (train.engine=megatron):
    "megatron.core.distributed.param_and_grad_buffer",  # the param and grad buffers
    "megatron.core.optimizer.optimizer",  # found-inf flag, unit loss scale
    "megatron.core.optimizer.distrib_optimizer",  # optimizer-state shards made on load
    "megatron.core.optimizer.clip_grads",  # norm and clipping scratch tensors
    "megatron.core.optimizer.grad_scaler",  # the loss scale
)


class _CpuCuda(types.SimpleNamespace):
    """``torch.cuda`` as the pipeline code uses it, answered for a CPU run."""

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)


def _cpu_device(device):
    return "cpu" if device is not None and torch.device(device).type == "cuda" else device


class _CpuTorch(types.ModuleType):
    """``torch`` with CUDA device requests in tensor factories mapped to CPU."""

    def __init__(self, rng: bool = False) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda(current_device=lambda: "cpu", synchronize=lambda *a, **k: None)
        if rng:  # the RNG tracker's module: the CPU generator stands in for the CUDA one
            self.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
            self.cuda.manual_seed = lambda seed: torch.manual_seed(seed)

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def zeros(self, *args, device=None, **kwargs):
        return torch.zeros(*args, device=_cpu_device(device), **kwargs)

    def empty(self, *args, device=None, **kwargs):
        return torch.empty(*args, device=_cpu_device(device), **kwargs)

    def tensor(self, *args, device=None, **kwargs):
        return torch.tensor(*args, device=_cpu_device(device), **kwargs)


def needed() -> bool:
    return not torch.cuda.is_available()


# Megatron's CUDA RNG tracker keeps named generator states ("model-parallel-rng", ...) and
# swaps one in around work in a tensor-parallel region (``tracker.fork()``: the sequence-
# parallel embedding and layers use it) and around a recomputed forward
# (``CheckpointFunction``, full and selective recompute). On CPU its "CUDA" generator is
# the CPU generator, the one dropout draws from there: the tracker's module reads and sets
# it in place of the CUDA one, ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` included,
# and ``distributed.seed_cuda_rng_tracker`` seeds it as on GPU.
_RNG_MODULE = "megatron.core.tensor_parallel.random"


def _cpu_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


_RNG_BRIDGE = {"_get_cuda_rng_state": _cpu_rng_state, "_set_cuda_rng_state": _set_cpu_rng_state}
_RNG_ORIGINALS: dict[str, object] = {}


def install() -> None:
    """Give Megatron's pipeline modules the CPU view of ``torch`` (no-op with CUDA)."""
    if not needed():
        return
    for name in _PATCHED_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _CpuTorch):
            module.torch = _CpuTorch()
    for owner, attribute, bridge in _tensor_method_users():
        function = getattr(owner, attribute)
        if not hasattr(function, "_cpu_bridge_original"):
            setattr(owner, attribute, _bridged(function, bridge))
    rng = importlib.import_module(_RNG_MODULE)
    if not isinstance(rng.torch, _CpuTorch):
        rng.torch = _CpuTorch(rng=True)
    for name, replacement in _RNG_BRIDGE.items():
        current = getattr(rng, name)
        if current is not replacement:
            _RNG_ORIGINALS[name] = current
            setattr(rng, name, replacement)


def uninstall() -> None:
    for name in _PATCHED_MODULES:
        importlib.import_module(name).torch = torch
    for owner, attribute, _ in _tensor_method_users():
        function = getattr(owner, attribute)
        setattr(owner, attribute, getattr(function, "_cpu_bridge_original", function))
    rng = importlib.import_module(_RNG_MODULE)
    rng.torch = torch
    for name, original in _RNG_ORIGINALS.items():
        setattr(rng, name, original)


# Tensor methods that no module-level view can answer, redirected only while the Megatron
# function that calls them runs (on the training thread only):
# - The distributed optimizer sorts parameters, and gradient clipping checks gradients, by
#   their type *name* ('torch.cuda.FloatTensor', 'torch.cuda.BFloat16Tensor'): a CPU
#   tensor's ``.type()`` gives the CUDA name of its dtype.
# - ``LanguageModule.setup_embeddings_and_output_layer`` (tied embeddings under pipeline
#   parallelism) moves the last stage's copy with ``weight.data.cuda()`` before summing it
#   with the first stage's over the embedding group: ``.cuda()`` leaves a CPU tensor where
#   it is, the device of a CPU run.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cuda_type_names():
    real_type = torch.Tensor.type

    def type_as_on_cuda(self, dtype=None, non_blocking=False, **kwargs):
        name = real_type(self, dtype, non_blocking, **kwargs)
        return _CUDA_TYPE_NAMES.get(name, name) if dtype is None else name

    torch.Tensor.type = type_as_on_cuda
    try:
        yield
    finally:
        torch.Tensor.type = real_type


@contextlib.contextmanager
def _cuda_copies_stay_on_cpu():
    real_cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = real_cuda


Bridge = Callable[[], contextlib.AbstractContextManager]


def _tensor_method_users() -> list[tuple[object, str, Bridge]]:
    """(owner, attribute, bridge) of each Megatron function that calls a bridged method."""
    distrib_optimizer = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    language_module = importlib.import_module(
        "megatron.core.models.common.language_module.language_module"
    )
    return [
        (distrib_optimizer.DistributedOptimizer, "__init__", _cuda_type_names),
        # the name optimizer.py calls
        (optimizer, "clip_grad_by_total_norm_fp32", _cuda_type_names),
        (
            language_module.LanguageModule,
            "setup_embeddings_and_output_layer",
            _cuda_copies_stay_on_cpu,
        ),
    ]


def _bridged(function, bridge: Bridge):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with bridge():
            return function(*args, **kwargs)

    wrapper._cpu_bridge_original = function
    return wrapper


def skip_deepspeed_shm_op() -> None:
    """Stop DeepSpeed's communication layer on CPU from JIT-building its shared-memory
    all-reduce op.

    ``deepspeed.comm.torch.TorchBackend`` loads ``deepspeed_shm_comm`` through
    ``torch.utils.cpp_extension`` at every start, and that load takes a lock file in
    ``~/.cache/torch_extensions``. A rank killed while holding it (a Slurm requeue, a time
    limit, Ctrl-C during the first build) leaves the file behind, and every later DeepSpeed
    start on the machine waits on it forever. The op only serves ``inference_all_reduce``
    when ``LOCAL_SIZE`` is set, which training never uses: gradients go through gloo. Without
    it the first start is also ~30 s faster and needs no C++ compiler. No-op with CUDA.
    """
    if not needed():
        return
    # importlib, not ``import deepspeed.comm.torch as ...``: deepspeed.comm's namespace has
    # an attribute ``torch`` (the real torch) that the import statement would resolve to.
    comm_torch = importlib.import_module("deepspeed.comm.torch")
    comm_torch.build_shm_op = lambda: None
