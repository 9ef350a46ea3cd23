"""Expand a sweep file (sizes x variants x token budgets x seeds) into validated runs.

    from cqk_megatron.planner.sweep import expand_sweep

    runs = expand_sweep("configs/sweeps/ladder.yaml")
    # [{"name": "ladder-1b-coupled-s0", "config": ".../configs/models/1b.yaml",
    #   "overrides": ["name=ladder-1b-coupled-s0", "seed=0", ...],
    #   "resources": {"nodes": 4, "gpus_per_node": 8, ...},
    #   "schedule": {"tokens": ..., "train_steps": ..., "lr": ..., ...},
    #   "pending": []}, ...]

The schema is documented at the top of ``configs/sweeps/ladder.yaml`` and typed by
``Sweep`` (read by ``config.read_yaml`` and ``config.from_dict``, as run configs are). Every run is
planned by ``planner.runs.plan_config`` (the config file with the run's overrides, checked
by ``validate`` on ``world_size=nodes * gpus_per_node``) here, so an impossible layout
fails before anything is submitted. Run names are deterministic: ``{name}-{size}-{variant}
[-t{tokens per param}]-s{seed}`` (the budget part only when a size has several budgets).
A variant is a preset of the registry (``variants.VARIANTS``): its coupling and scoring
become the ``attention.coupling`` / ``attention.scoring`` overrides
(``planner.runs.variant_overrides``), so a preset registered from code needs no file.
A size's token budget in tokens per parameter is read against its
standard-attention model, counted without building it (``planner.parameters``).

Training-schedule values (learning rate, steps, warmup, evaluation interval) go into
the overrides under ``SCHEDULE_FIELDS``; a field that ``TrainConfig`` lacks (renamed in
the engine, say) is listed in ``pending`` instead of failing, and its value stays in
``schedule`` for the launcher.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cqk_megatron.config import (
    CONFIGS_DIR,
    VARIANTS,
    ConfigError,
    RunConfig,
    from_dict,
    load_config,
    read_yaml,
)
from cqk_megatron.planner.parameters import config_parameters
from cqk_megatron.planner.runs import plan_config, run_overrides

# schedule key -> config field that the training engine reads
SCHEDULE_FIELDS = {
    "lr": "train.optimizer.lr",
    "min_lr": "train.schedule.min_lr",
    "train_steps": "train.train_steps",
    "warmup_steps": "train.schedule.warmup_steps",
    "eval_interval": "train.eval_interval",
}
Several = list | int | float | str | None  # a list, or one value standing for a list of it


# --- the sweep file, typed (``config.from_dict``: unknown keys, types, required keys) --------


@dataclass
class SizeLayout:
    tensor_parallel: int
    pipeline_parallel: int
    nodes: int
    gpus_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class SweepSize:
    """One entry of ``sizes``: a model, its optimiser settings and layout."""

    model: str
    lr: float
    global_batch_size: int
    micro_batch_size: int
    layout: SizeLayout
    resources: dict[str, Any] = field(default_factory=dict)
    seeds: list[int] | int | None = None
    tokens_per_param: list[float] | float | None = None
    tokens: int | float | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    variants: list[str] | str | None = None


@dataclass
class SweepSchedule:
    warmup_fraction: float = 0.01
    min_lr_ratio: float = 0.1
    eval_fraction: float = 0.05


@dataclass
class Sweep:
    sizes: dict[str, SweepSize]
    name: str | None = None
    variants: list[str] | str = field(default_factory=lambda: ["standard"])
    seeds: list[int] | int = field(default_factory=lambda: [0])
    tokens_per_param: list[float] | float = field(default_factory=lambda: [20])
    common: dict[str, Any] = field(default_factory=dict)
    schedule: SweepSchedule = field(default_factory=SweepSchedule)


def load_sweep(path: str | Path) -> Sweep:
    """The sweep file, typed; a clear error naming the file and key otherwise."""
    sweep = from_dict(Sweep, read_yaml(path, "sweep file"), str(path))
    if not sweep.sizes:
        raise ConfigError(f"{path}: 'sizes' must map size names (e.g. 1b) to their settings")
    for size, spec in sweep.sizes.items():
        bad = [v for v in _listed(spec.variants, sweep.variants) if v not in VARIANTS]
        if bad:
            raise ConfigError(
                f"{path}: 'sizes.{size}': unknown variants {bad}; choose from {list(VARIANTS)}"
            )
    return sweep


def _listed(value: Several, default: Several) -> list:
    value = default if value is None else value
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _override(dotted: str, value) -> str:
    """``dotted=value`` with the value in YAML flow style, as ``apply_overrides`` reads it."""
    text = yaml.safe_dump(value, default_flow_style=True).replace("\n...\n", "").strip()
    return f"{dotted}={text}"


def _has_field(dotted: str) -> bool:
    """Whether ``RunConfig`` has the (nested) field ``dotted`` today."""
    cls = RunConfig
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        cls = hints[part]
    return True


def _resolve_model(path: Path, model: str) -> Path:
    for candidate in (path.parent / model, CONFIGS_DIR / model):
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(
        f"{path}: model file '{model}' not found next to the sweep or under {CONFIGS_DIR}"
    )


_TOTALS: dict[str, int] = {}


def standard_parameters(model_path: Path, overrides: list[str]) -> int:
    """Total parameters of the size's model with standard attention, counted without
    building it or starting a process group."""
    key = repr((str(model_path), overrides))
    if key not in _TOTALS:
        _TOTALS[key] = config_parameters(load_config(model_path, overrides), "standard")
    return _TOTALS[key]


# --- expansion --------------------------------------------------------------------------------


@dataclass
class _Size:
    """One size of a sweep, resolved: its model file, overrides and step size."""

    name: str
    spec: SweepSize
    model_path: Path
    overrides: list[str]
    tokens_per_step: int
    params: int | None  # the standard model's count (None: a fixed token budget)


def _resolve_size(path: Path, name: str, spec: SweepSize) -> _Size:
    model_path = _resolve_model(path, spec.model)
    overrides = [_override(k, v) for k, v in spec.overrides.items()]
    seq_length = load_config(model_path, overrides).model.seq_length
    params = None if spec.tokens is not None else standard_parameters(model_path, overrides)
    return _Size(name, spec, model_path, overrides, spec.global_batch_size * seq_length, params)


def _schedule(size: _Size, budget: float, schedule: SweepSchedule) -> dict:
    """Tokens, steps and learning-rate schedule of one token budget of ``size``."""
    tokens = int(size.spec.tokens) if size.params is None else int(budget * size.params)
    train_steps = math.ceil(tokens / size.tokens_per_step)
    lr = float(size.spec.lr)
    return {
        "tokens": tokens,
        "tokens_per_param": None if size.params is None else tokens / size.params,
        "train_steps": train_steps,
        "lr": lr,
        "min_lr": lr * schedule.min_lr_ratio,
        "warmup_steps": max(1, round(schedule.warmup_fraction * train_steps)),
        "eval_interval": max(1, round(schedule.eval_fraction * train_steps)),
    }


def expand_sweep(path: str | Path) -> list[dict]:
    """Every run of the sweep, validated; see the module docstring for the shape."""
    path = Path(path)
    sweep = load_sweep(path)
    sweep_name = sweep.name or path.stem
    runs, names = [], set()
    for size_name, spec in sweep.sizes.items():
        size = _resolve_size(path, size_name, spec)
        budgets = _listed(spec.tokens_per_param, sweep.tokens_per_param)
        for budget in budgets:
            schedule = _schedule(size, budget, sweep.schedule)
            for variant in _listed(spec.variants, sweep.variants):
                for seed in _listed(spec.seeds, sweep.seeds):
                    budget_part = f"-t{budget:g}" if len(budgets) > 1 else ""
                    name = f"{sweep_name}-{size_name}-{variant}{budget_part}-s{seed}"
                    if name in names:
                        raise ConfigError(f"{path}: two runs are named '{name}'; make sizes unique")
                    names.add(name)
                    runs.append(_make_run(path, name, size, variant, seed, sweep.common, schedule))
    return runs


def _make_run(
    path: Path, name: str, size: _Size, variant: str, seed: int, common: dict, schedule: dict
) -> dict:
    # the registry's preset, through the planner
    spec, layout = size.spec, size.spec.layout
    rest = [_override(k, v) for k, v in common.items()]
    rest += size.overrides
    rest += [
        f"parallel.tensor_parallel={layout.tensor_parallel}",
        f"parallel.pipeline_parallel={layout.pipeline_parallel}",
        f"train.global_batch_size={spec.global_batch_size}",
        f"train.micro_batch_size={spec.micro_batch_size}",
    ]
    pending = []
    for key, dotted in SCHEDULE_FIELDS.items():
        if _has_field(dotted):
            rest.append(_override(dotted, schedule[key]))
        else:
            pending.append(dotted)
    world_size = layout.world_size
    try:
        plan_config(
            size.model_path, variant, name=name, seed=seed, overrides=rest, world_size=world_size
        )
    except ConfigError as error:
        raise ConfigError(f"{path}: run '{name}' (world size {world_size}): {error}") from error
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    resources = {
        **spec.resources,
        "nodes": layout.nodes,
        "gpus_per_node": layout.gpus_per_node,
        "tensor_parallel": tp,
        "pipeline_parallel": pp,
        "data_parallel": world_size // (tp * pp),
        "world_size": world_size,
    }
    return {
        "name": name,
        "config": str(size.model_path),
        "overrides": run_overrides(variant, name, seed, rest),
        "resources": resources,
        "schedule": {**schedule, "tokens_per_step": size.tokens_per_step},
        "pending": pending,
    }
