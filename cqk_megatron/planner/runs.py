"""From a variant, a size (a config file or a ``RunConfig``), a seed and a budget to one
validated run config: the one place that turns a variant into config fields, and the one
that plans and validates a run. ``planner.sweep`` (``launch --sweep``, ``cqk analyze
ladder``), ``repro``, ``bench`` (``cqk bench``), ``cli.plan`` (``cqk plan``) and ``params``
(``cqk params``) all go through it; ``tests/test_entry_points.py`` checks that they
produce the same config.

    config = plan_config("configs/models/60m.yaml", "coupled", name="r", seed=0,
                         overrides=["train.train_steps=100"], world_size=8)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cqk_megatron.config import RunConfig, load_config, validate
from cqk_megatron.variants import pair


def variant_overrides(variant: str) -> list[str]:
    """``variant``'s attention (a preset name or ``coupling+scoring``) as the
    ``attention.coupling=... attention.scoring=...`` overrides a launcher passes on (an
    unknown name raises ``UnknownVariantError``)."""
    coupling, scoring = pair(variant)
    return [f"attention.coupling={coupling}", f"attention.scoring={scoring}"]


def with_variant(config: RunConfig, variant: str) -> RunConfig:
    """``config`` with ``variant``'s coupling and scoring; nothing else changes."""
    coupling, scoring = pair(variant)
    attention = dataclasses.replace(config.attention, coupling=coupling, scoring=scoring)
    return dataclasses.replace(config, attention=attention)


def one_rank(config: RunConfig) -> RunConfig:
    """``config`` on one process: TP=PP=1, no virtual pipeline, no sequence parallel.
    What a parameter count, a memory estimate or a one-process benchmark describes."""
    parallel = dataclasses.replace(
        config.parallel,
        tensor_parallel=1,
        pipeline_parallel=1,
        virtual_pipeline=None,
        sequence_parallel=False,
        world_size=1,
    )
    return dataclasses.replace(config, parallel=parallel)


def run_overrides(
    variant: str, name: str | None = None, seed: int | None = None, overrides: list[str] = ()
) -> list[str]:
    """The overrides of one run, in the order that ``plan_config`` applies them: name,
    seed, the variant's attention, then ``overrides`` (the size's, the schedule's, the
    user's: last wins)."""
    head = [] if name is None else [f"name={name}"]
    head += [] if seed is None else [f"seed={int(seed)}"]
    return [*head, *variant_overrides(variant), *overrides]


def plan_config(
    source: str | Path | RunConfig | None,
    variant: str,
    *,
    name: str | None = None,
    seed: int | None = None,
    overrides: list[str] = (),
    world_size: int | None = None,
    single_process: bool = False,
) -> RunConfig:
    """One validated run: ``source`` (a config file, ``None`` for the defaults, or a
    ``RunConfig``) with ``run_overrides(variant, name, seed, overrides)``, on one process
    if ``single_process``, checked by ``validate(config, world_size)``. A bad field raises
    ``ConfigError`` naming it; an unknown variant ``UnknownVariantError``."""
    if isinstance(source, RunConfig):
        if overrides:
            raise ValueError("plan_config: overrides apply to a config file, not a RunConfig")
        config = with_variant(source, variant)
        if name is not None:
            config = dataclasses.replace(config, name=name)
        if seed is not None:
            config = dataclasses.replace(config, seed=int(seed))
    else:
        config = load_config(source, run_overrides(variant, name, seed, list(overrides)))
    if single_process:
        config = one_rank(config)
        world_size = 1 if world_size is None else world_size
    return validate(config, world_size=world_size)
