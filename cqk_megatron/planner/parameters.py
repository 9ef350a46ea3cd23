"""A variant's parameter count, as token budgets, analysis tables, ``cqk-params`` and
``cqk-plan`` use it: no Megatron model is built and no process group is started, so a
login node, a notebook or an analysis machine counts a 7B model at once.

The count is ``perf.memory.total_parameters``: the registry's coupling and scoring
modules built on the meta device (``variants``), plus the dense tensors as Megatron-Core's
``GPTModel`` allocates them. ``tests/test_parameter_count.py``, ``tests/test_perf.py`` and
``tests/test_entry_points.py`` compare it with built Megatron models.
"""

from __future__ import annotations

from cqk_megatron.config import RunConfig, validate
from cqk_megatron.perf.memory import total_parameters
from cqk_megatron.planner.runs import one_rank, with_variant


def variant_config(config: RunConfig, variant: str) -> RunConfig:
    """``config`` with ``variant``'s attention (a preset name or ``coupling+scoring``), on
    one process (``planner.runs.one_rank``); not validated."""
    return one_rank(with_variant(config, variant))


def count_parameters(config: RunConfig, variant: str | None = None) -> int:
    """Total parameters of ``config``'s model (TP=PP=1) with ``variant`` attention (by
    default the config's own), after ``validate``: a bad config raises ``ConfigError``
    naming the field (an unknown ``variant`` raises ``UnknownVariantError``)."""
    config = one_rank(config) if variant is None else variant_config(config, variant)
    return total_parameters(validate(config))
