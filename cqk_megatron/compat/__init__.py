"""Every patch this package makes to torch, Megatron-Core and DeepSpeed, in one place.

A patch here is a change to another library's module or class from outside it: an
attribute replaced, a function wrapped, a private global reset. Each one is listed in
``PATCHES`` with why it exists, the version it was written for, and what would retire it
(an upstream fix, or the library's extension point once it serves). The code of each lives
in this folder:

- ``cpu_bridge``: Megatron-Core's CUDA assumptions answered on CPU, and DeepSpeed's
  communication layer on CPU kept from JIT-building an op training never uses (no-ops with CUDA);
- ``save_writes``: the file writes inside Megatron's and DeepSpeed's collective saves,
  guarded while a checkpoint is written (``training/checkpoint.guarded_writes``);
- ``megatron_state``: two private globals of megatron-core 0.16, and the view of ``torch``
  its blended dataset gets when built outside a process group.

``tests/test_compat.py`` lists them and fails when a patched function's parameters differ
from those it was written against: a new pin of a library shows which patch to read again.
Nothing here is imported by importing this package: each module imports its library when
it is used.
"""

from __future__ import annotations

from dataclasses import dataclass

MEGATRON = "megatron-core 0.16.1"
DEEPSPEED = "deepspeed 0.19.8"
TORCH = "torch 2.13"


@dataclass(frozen=True)
class Patch:
    """One change made to a library from outside it."""

    target: str  # "module:attribute" or "module:Class.method"
    how: str  # what is done to it
    why: str
    written_for: str  # the pinned version the patch was written and tested against
    retire_when: str  # the upstream fix or extension point that would make it unneeded
    where: str  # the module of this folder that makes it
    # The patched function's parameters as written for (``inspect.signature`` names, or a
    # builtin's documented call); None where the target is not a function.
    parameters: tuple[str, ...] | None = None


_MEGATRON_VIEW = (
    "module global `torch` replaced by a view whose tensor factories and torch.cuda calls "
    "mean CPU (every other attribute is the real torch)"
)
_NO_CUDA = "Megatron-Core 0.16 hard-codes CUDA here; a CPU/gloo run (tests, CI) needs CPU"
_RETIRE_DEVICE = "Megatron-Core taking the device from its process group or config"

_VIEW_MODULES = (
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.tensor_parallel.random",
)

PATCHES: tuple[Patch, ...] = (
    *(
        Patch(f"{m}:torch", _MEGATRON_VIEW, _NO_CUDA, MEGATRON, _RETIRE_DEVICE, "cpu_bridge")
        for m in _VIEW_MODULES
    ),
    Patch(
        "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
        "replaced by torch.get_rng_state on CPU",
        "activation recompute and the RNG tracker save the CUDA generator; on CPU dropout "
        "draws from the CPU one",
        MEGATRON,
        "a device-agnostic RNG tracker in Megatron-Core",
        "cpu_bridge",
        ("device", "clone", "graph_safe"),
    ),
    Patch(
        "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
        "replaced by torch.set_rng_state on CPU",
        "as _get_cuda_rng_state",
        MEGATRON,
        "a device-agnostic RNG tracker in Megatron-Core",
        "cpu_bridge",
        ("new_state", "device", "graph_safe"),
    ),
    Patch(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__",
        "wrapped on CPU: Tensor.type() names a CPU tensor's dtype as its CUDA type",
        "it sorts parameters by 'torch.cuda.*Tensor' type names",
        MEGATRON,
        "Megatron-Core comparing dtypes instead of CUDA type names",
        "cpu_bridge",
        (
            "self",
            "optimizer",
            "config",
            "grad_scaler",
            "init_state_fn",
            "model_chunks",
            "per_model_buffers",
            "data_parallel_group",
            "data_parallel_group_gloo",
            "data_parallel_group_idx",
            "distributed_optimizer_instance_id",
        ),
    ),
    Patch(
        "megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32",
        "wrapped on CPU, as DistributedOptimizer.__init__",
        "gradient clipping checks gradients by CUDA type names",
        MEGATRON,
        "Megatron-Core comparing dtypes instead of CUDA type names",
        "cpu_bridge",
        ("parameters", "max_norm", "total_norm", "use_decoupled_grad"),
    ),
    Patch(
        "megatron.core.models.common.language_module.language_module:"
        "LanguageModule.setup_embeddings_and_output_layer",
        "wrapped on CPU: weight.data.cuda() leaves a CPU tensor where it is",
        "tied embeddings under pipeline parallelism move the last stage's copy to CUDA",
        MEGATRON,
        "Megatron-Core moving the copy to the weight's own device",
        "cpu_bridge",
        ("self",),
    ),
    Patch(
        "torch:Tensor.type",
        "replaced while the two functions above run (training thread): a CPU tensor's type "
        "name is its dtype's CUDA one",
        "those functions compare 'torch.cuda.*Tensor' names",
        TORCH,
        "as DistributedOptimizer.__init__",
        "cpu_bridge",
        ("dtype", "non_blocking", "kwargs"),
    ),
    Patch(
        "torch:Tensor.cuda",
        "replaced while setup_embeddings_and_output_layer runs: returns the tensor itself",
        "as setup_embeddings_and_output_layer",
        TORCH,
        "as setup_embeddings_and_output_layer",
        "cpu_bridge",
        ("device", "non_blocking", "memory_format"),
    ),
    Patch(
        "deepspeed.comm.torch:build_shm_op",
        "replaced by a no-op on CPU",
        "DeepSpeed's communication layer on CPU JIT-builds a shared-memory all-reduce at "
        "every start under a lock file that a killed rank leaves behind (every later start "
        "then waits on it); training never uses the op",
        DEEPSPEED,
        "a DeepSpeed setting that skips the build, or a lock with a timeout",
        "cpu_bridge",
        (),
    ),
    Patch(
        "torch:save",
        "wrapped while a checkpoint is written: records the path, defers a failed write",
        "a rank whose write fails inside a library's collective save must still go through "
        "its remaining collectives, or its peers hang",
        TORCH,
        "Megatron's and DeepSpeed's saves reporting a rank's write error collectively "
        "(DeepSpeed's checkpoint engine is the extension point for its own files)",
        "save_writes",
        (
            "obj",
            "f",
            "pickle_module",
            "pickle_protocol",
            "_use_new_zipfile_serialization",
            "_disable_byteorder_record",
        ),
    ),
    Patch(
        "megatron.core.dist_checkpointing.serialization:save_config",
        "wrapped while a checkpoint is written, as torch.save",
        "as torch.save: rank 0 writes metadata.json between two collectives",
        MEGATRON,
        "as torch.save",
        "save_writes",
        ("config", "checkpoint_dir"),
    ),
    Patch(
        "deepspeed.runtime.engine:copyfile",
        "wrapped while a checkpoint is written, as torch.save",
        "as torch.save: rank 0 copies zero_to_fp32.py before a barrier",
        DEEPSPEED,
        "as torch.save",
        "save_writes",
        ("src", "dst", "follow_symlinks"),
    ),
    Patch(
        "megatron.core.parallel_state:_EMBEDDING_GLOBAL_RANKS",
        "reset to None before the groups are rebuilt",
        "destroy_model_parallel forgets the embedding group but not its ranks: a later "
        "layout's middle stage thought itself a holder of the tied embedding",
        MEGATRON,
        "destroy_model_parallel resetting it (upstream)",
        "megatron_state",
    ),
    Patch(
        "megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue",
        "set to a results queue whose helper process dies with its parent",
        "Megatron's own queue helper, deaf to SIGTERM, outlived a rank killed with SIGKILL",
        MEGATRON,
        "a parent-death guard in Megatron's writer-results manager",
        "megatron_state",
    ),
    Patch(
        "megatron.core.datasets.blended_dataset:torch",
        "module global `torch` replaced, while a dataset is built outside a process group, "
        "by a view whose torch.distributed.get_rank() answers 0",
        "BlendedDataset calls get_rank() without checking for a group (GPTDataset checks); "
        "the data tools and the analysis build datasets in a plain process",
        MEGATRON,
        "BlendedDataset checking torch.distributed.is_initialized() first, as GPTDataset does",
        "megatron_state",
    ),
    Patch(
        "megatron.core.dist_checkpointing.strategies.filesystem_async:_get_write_results_queue",
        "bypassed: its global is set first (above)",
        "as _results_queue",
        MEGATRON,
        "as _results_queue",
        "megatron_state",
        (),
    ),
)
