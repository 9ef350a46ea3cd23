"""A variant's parameter count as the planner asks for it: ``config`` on one rank with
``variant``'s attention, validated, then counted by the one count
(``cqk_megatron.model.params``)."""

from __future__ import annotations

from cqk_megatron.config import RunConfig, validate
from cqk_megatron.model.params import total_parameters
from cqk_megatron.planner.runs import one_rank, with_variant


def variant_config(config: RunConfig, variant: str) -> RunConfig:
    """``config`` with ``variant``'s attention (a preset name or ``coupling+scoring``), on
    one process (``planner.runs.one_rank``); not validated."""
    return one_rank(with_variant(config, variant))


def config_parameters(config: RunConfig, variant: str | None = None) -> int:
    """``params.total_parameters`` of ``config`` (TP=PP=1) with ``variant`` attention (by
    default the config's own), after ``validate``: a bad config raises ``ConfigError``
    naming the field (an unknown ``variant`` raises ``UnknownVariantError``)."""
    config = one_rank(config) if variant is None else variant_config(config, variant)
    return total_parameters(validate(config))
