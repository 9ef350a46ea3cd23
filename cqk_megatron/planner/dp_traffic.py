"""The data-parallel collectives an engine issues per step and rank, for the step-time
model: kind, elements, dtype, calls, and whether each is issued inside the backward.

Bucket rule: Megatron's ``max(40M, 1M x DP)`` elements.
"""

from __future__ import annotations

from dataclasses import dataclass

from cqk_megatron.config import RunConfig
from cqk_megatron.model.params import stage_parameters


@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce | reduce_scatter | all_gather
    elements: int  # of the whole buffer, per call
    dtype: str
    calls: int  # per step
    overlapped: bool  # issued inside the backward (or forward, for ZeRO-3's gathers)
    what: str = "gradients"


def bucket_elements(dp: int) -> int:
    return max(40_000_000, 1_000_000 * dp)


def _split(total: int, bucket: int) -> tuple[int, int]:
    calls = max(1, -(-total // bucket))
    return calls, -(-total // calls)


def dp_collectives(config: RunConfig) -> list[Collective]:
    p, t = config.parallel, config.train
    dp = (p.world_size or 1) // (p.tensor_parallel * p.pipeline_parallel)
    if dp == 1:
        return []
    params = stage_parameters(config, p.tensor_parallel, p.pipeline_parallel, first=True)
    micro = t.global_batch_size // (t.micro_batch_size * dp)
    calls, size = _split(params, bucket_elements(dp))
    low = "bf16" if t.precision == "bf16" else t.precision
    overlap = t.overlap_grad_reduce
    if t.engine == "megatron":
        return [
            Collective("reduce_scatter", size, "fp32", calls, overlap),
            Collective("all_gather", size, low, calls, False, "parameters"),
        ]
    if t.zero_stage == 3:
        return [
            Collective("all_gather", size, low, 2 * calls * micro, True, "parameters"),
            Collective("reduce_scatter", size, "fp32", calls * micro, overlap),
        ]
    per_step = calls * (micro if t.zero_stage == 2 else 1)
    return [
        Collective("reduce_scatter", size, "fp32", per_step, overlap),
        Collective("all_gather", size, low, calls, False, "parameters"),
    ]
