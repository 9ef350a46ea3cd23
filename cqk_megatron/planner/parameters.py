"""A variant's run config, and the parameter count that token budgets and analysis tables
use: no Megatron model is built and no process group is started, so a login node, a
notebook or an analysis machine counts a 7B model at once.

The count is ``perf.memory.total_parameters``: the registry's coupling and scoring
modules built on the meta device (``variants``), plus the dense tensors as Megatron-Core's
``GPTModel`` allocates them. ``tests/test_parameter_count.py`` and ``tests/test_perf.py``
compare it with built Megatron models; ``cqk-params`` (``params.py``) still prints the
built model's own count.
"""

from __future__ import annotations

import dataclasses

from cqk_megatron.config import RunConfig, validate
from cqk_megatron.perf.memory import total_parameters
from cqk_megatron.variants import pair


def variant_config(config: RunConfig, variant: str) -> RunConfig:
    """``config`` with ``variant``'s attention (a preset name or ``coupling+scoring``), on
    one rank (TP=PP=1)."""
    coupling, scoring = pair(variant)
    attention = dataclasses.replace(config.attention, coupling=coupling, scoring=scoring)
    return _one_rank(dataclasses.replace(config, attention=attention))


def _one_rank(config: RunConfig) -> RunConfig:
    parallel = dataclasses.replace(config.parallel, tensor_parallel=1, pipeline_parallel=1)
    return dataclasses.replace(config, parallel=parallel)


def count_parameters(config: RunConfig, variant: str | None = None) -> int:
    """Total parameters of ``config``'s model (TP=PP=1) with ``variant`` attention (by
    default the config's own), after ``validate``: a bad config raises ``ConfigError``
    naming the field (an unknown ``variant`` raises ``UnknownVariantError``)."""
    config = _one_rank(config) if variant is None else variant_config(config, variant)
    return total_parameters(validate(config))
