"""The data-parallel collectives a run's engine issues in one step, on one rank.

Torch-free: a pure function of the ``RunConfig`` (and the data-parallel size), read from
what DeepSpeed 0.19.8 (``runtime/zero/stage_1_and_2.py``, ``runtime/engine.py``,
``runtime/bf16_optimizer.py``) and megatron-core 0.16.1 (``distributed/
param_and_grad_buffer.py``, ``optimizer/distrib_optimizer.py``) do with the settings
``training/engines/deepspeed.py`` and ``training/engines/megatron.py`` give them.
``tests/test_comm_audit.py`` records what the real engines issue on gloo ranks and
compares it with this.

The interface: ``dp_collectives(config, dp)`` returns a list of ``Collective`` (what, kind,
elements, dtype, calls, whether issued inside the backward); ``reduce_bucket_elements``
is the bucket rule both engines use. Elements count a collective's whole buffer (the
buffer reduced, or the buffer a gather fills), without the engines' alignment padding:
Megatron starts each parameter at a multiple of 64 elements and ends each bucket at a
multiple of lcm(DP, 128); DeepSpeed pads each flat parameter group to a multiple of 2 x DP.
The scalars the engines reduce (gradient norm, overflow flag) are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cqk_megatron.config import RunConfig
from cqk_megatron.model.params import stage_parameters
from cqk_megatron.training.engines import DISTOPT, engine_of

KINDS = ("all_reduce", "reduce_scatter", "all_gather")

# Megatron-LM's bucket rule with overlap_grad_reduce: max(40M, 1M x DP) elements
# (megatron/training/arguments.py, ``--ddp-bucket-size`` default).
MEGATRON_BUCKET_FLOOR = 40_000_000
MEGATRON_BUCKET_PER_RANK = 1_000_000
# A backward fills at least this many buckets, so that all but the last (about 7/8 of
# the bytes) are reduced while autograd still computes: a size rule alone makes a 60M or
# 150M model one bucket, reduced after the whole backward.
BUCKETS_PER_BACKWARD = 8
# DeepSpeed's buffered_allreduce_fallback bucket (``MEMORY_OPT_ALLREDUCE_SIZE``), which
# BF16_Optimizer's ZeRO-1 reduction uses whatever the config says.
DEEPSPEED_FALLBACK_BUCKET = 500_000_000
# DeepSpeed ZeRO-1/2's parameter groups (``engines.deepspeed.param_groups``): matrices with
# weight decay, vectors without; one all-gather each after the step.
DEEPSPEED_PARAM_GROUPS = 2


@dataclass(frozen=True)
class Collective:
    """Calls of one kind a step issues over the data-parallel group, on one rank.

    ``elements``: the sum over the step's ``calls`` of each call's buffer. ``in_backward``:
    issued from a gradient hook while autograd still computes gradients (overlapped with
    it), else after the backward (exposed, unless something else runs beside it)."""

    what: str  # gradient reduction | parameter gather
    kind: str  # one of KINDS
    elements: int
    dtype: str  # fp32 | bf16 | fp64
    calls: int
    in_backward: bool

    @property
    def bytes(self) -> int:
        return self.elements * {"fp32": 4, "bf16": 2, "fp64": 8}[self.dtype]


def reduce_bucket_elements(parameters: int, dp: int) -> int:
    """The gradient bucket, in elements, for a rank holding ``parameters`` under data
    parallelism ``dp``: Megatron's max(40M, 1M x DP), made smaller where the rank holds
    fewer than ``BUCKETS_PER_BACKWARD`` such buckets. Even, as DeepSpeed's all-gather
    bucket must be."""
    megatron = max(MEGATRON_BUCKET_FLOOR, MEGATRON_BUCKET_PER_RANK * dp)
    by_model = math.ceil(parameters / BUCKETS_PER_BACKWARD)
    return max(2, 2 * math.ceil(min(megatron, by_model) / 2))


def rank_parameters(config: RunConfig) -> int:
    """Parameters on the first pipeline stage's ranks (the embedding's; at PP=1 the whole
    model's TP shard), which the reduction buckets split."""
    p = config.parallel
    return stage_parameters(
        config, p.tensor_parallel, p.pipeline_parallel, first=True, last=p.pipeline_parallel == 1
    )


def micro_batches(config: RunConfig, dp: int) -> int:
    t = config.train
    return t.global_batch_size // (t.micro_batch_size * dp)


def dp_collectives(config: RunConfig, dp: int | None = None) -> list[Collective]:
    """The data-parallel gradient reductions and parameter gathers of one step, on a rank
    of the first pipeline stage. ``dp``: the data-parallel size (default: from
    ``parallel.world_size``). Empty at DP=1 (the engines skip them)."""
    dp = dp or _dp_from_world(config)
    if dp == 1:
        return []
    sharding = engine_of(config).sharding_at(config.train.zero_stage)
    if sharding == DISTOPT:
        return megatron_collectives(config, dp)
    return deepspeed_collectives(config, dp)


def _dp_from_world(config: RunConfig) -> int:
    p = config.parallel
    if p.world_size is None:
        raise ValueError("parallel.world_size is not set: pass the data-parallel size (dp=)")
    return p.data_parallel(p.world_size)


def _grad_dtype(config: RunConfig) -> str:
    """Both engines reduce gradients in fp32 under bf16 (``bf16_settings``,
    ``grad_reduce_in_fp32``), in the parameters' dtype otherwise."""
    return "fp64" if config.train.precision == "fp64" else "fp32"


def _param_dtype(config: RunConfig) -> str:
    return config.train.precision


def _bucketed(
    what: str, kind: str, elements: int, dtype: str, buckets: int, times: int, overlap: bool
) -> list[Collective]:
    """``times`` reductions of ``elements`` in ``buckets`` buckets each; with ``overlap``
    all but the last bucket of each are issued inside the backward (their share of the
    elements counted by bucket, the buckets taken as equal)."""
    if not overlap or buckets == 1:
        return [Collective(what, kind, elements * times, dtype, buckets * times, in_backward=False)]
    inside = elements * (buckets - 1) // buckets
    return [
        Collective(what, kind, inside * times, dtype, (buckets - 1) * times, in_backward=True),
        Collective(what, kind, (elements - inside) * times, dtype, times, in_backward=False),
    ]


def deepspeed_collectives(config: RunConfig, dp: int) -> list[Collective]:
    """DeepSpeed ZeRO-1/2 as ``engines.deepspeed`` configures it.

    - ZeRO-2 (``partition_gradients``) reduces every micro-batch's gradients
      (``reduce_ready_partitions_and_remove_grads``), bucket by bucket
      (``reduce_bucket_size``); each bucket is one fp32 all-reduce
      (``use_multi_rank_bucket_allreduce``, DeepSpeed's default). With ``overlap_comm`` the
      buckets go from the gradient hooks, the last from the epilogue after the backward;
      without it all go from the epilogue.
    - ZeRO-1 reduces once, at the accumulation boundary: from the last backward's hooks
      with ``overlap_comm`` (fp32 only: ``validate``), else after the backward
      (``reduce_gradients``, or BF16_Optimizer's ``buffered_allreduce_fallback`` in bf16).
    - After the step each rank's updated partition is all-gathered into every replica's
      parameters, one ``all_gather_into_tensor`` per parameter group.
    """
    t = config.train
    if t.zero_stage == 3 or t.offload_optimizer:
        raise ValueError(
            "perf.traffic models DeepSpeed ZeRO-1 and ZeRO-2 on the device; "
            f"train.zero_stage={t.zero_stage}, offload_optimizer={t.offload_optimizer} is not"
        )
    n = rank_parameters(config)
    bucket = reduce_bucket_elements(n, dp)
    pipelined = config.parallel.pipeline_parallel > 1
    bf16_zero1 = t.zero_stage == 1 and t.precision == "bf16"
    if bf16_zero1:  # BF16_Optimizer: DeepSpeed's fixed fallback bucket
        bucket = DEEPSPEED_FALLBACK_BUCKET
    buckets = math.ceil(n / bucket)
    overlap = t.overlap_grad_reduce and not pipelined and not bf16_zero1
    times = micro_batches(config, dp) if t.zero_stage == 2 and not pipelined else 1
    reductions = _bucketed(
        "gradient reduction", "all_reduce", n, _grad_dtype(config), buckets, times, overlap
    )
    gather = Collective(
        "parameter gather", "all_gather", n, _param_dtype(config), DEEPSPEED_PARAM_GROUPS, False
    )
    return [*reductions, gather]


def megatron_collectives(config: RunConfig, dp: int) -> list[Collective]:
    """Megatron's DDP with the distributed optimizer, as ``engines.megatron`` configures it.

    The fp32 gradient buffer accumulates every micro-batch and is reduce-scattered once a
    step: bucket by bucket from the gradient hooks of the last micro-batch's backward with
    ``overlap_grad_reduce`` (the buckets of ``reduce_bucket_elements``; each further
    virtual-pipeline chunk is one bucket), else one call per buffer after the backward
    (``finalize_model_grads``). After the step each bucket's updated parameters are
    all-gathered in the parameters' dtype.
    """
    n = rank_parameters(config)
    overlap = config.train.overlap_grad_reduce
    chunks = config.parallel.virtual_pipeline or 1
    buckets = math.ceil(n / chunks / reduce_bucket_elements(n // chunks, 1)) + chunks - 1
    buckets = buckets if overlap else chunks
    dtype = _grad_dtype(config)
    reduction = Collective("gradient reduction", "reduce_scatter", n, dtype, buckets, overlap)
    gather = Collective("parameter gather", "all_gather", n, _param_dtype(config), buckets, False)
    return [reduction, gather]
