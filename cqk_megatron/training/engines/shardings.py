"""The optimizer shardings, named once: who splits what over the data-parallel ranks.

A layout's ``optimizer_sharding`` (``parallel/layout.py``), the planner's candidates and
the memory model (``perf/``) all take their names from here; each engine's spec says which
of them it trains with (``deepspeed_spec.py``, ``megatron_spec.py``). Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

DDP = "ddp"  # plain data parallel: the benchmark's own optimizer (no shipped engine)
ZERO1 = "zero1"  # DeepSpeed ZeRO stage 1
ZERO2 = "zero2"
ZERO3 = "zero3"
DISTOPT = "distopt"  # Megatron's distributed optimizer


@dataclass(frozen=True)
class Sharding:
    """What one sharding splits over the data-parallel ranks."""

    optimizer: bool  # fp32 master weights and Adam moments
    gradients: bool  # reduce-scattered in each backward (ZeRO-2/3)
    parameters: bool  # the parameters themselves, gathered for each use (ZeRO-3)
    # offered with pipeline parallelism: ZeRO-2/3 reduce inside each backward, which
    # Megatron's pipeline schedule drives itself
    with_pipeline: bool
    zero_stage: int | None = None  # its number in ZeRO's terms (--zero 0-3), if any


SHARDINGS: Mapping[str, Sharding] = MappingProxyType(
    {
        DDP: Sharding(False, False, False, False, zero_stage=0),
        ZERO1: Sharding(True, False, False, True, zero_stage=1),
        ZERO2: Sharding(True, True, False, False, zero_stage=2),
        ZERO3: Sharding(True, True, True, False, zero_stage=3),
        DISTOPT: Sharding(True, False, False, True),
    }
)


def zero_aliases() -> dict[str, str]:
    """``"0"``-``"3"``: the sharding of that ZeRO stage (the planner's ``--zero 2``)."""
    return {str(s.zero_stage): name for name, s in SHARDINGS.items() if s.zero_stage is not None}
