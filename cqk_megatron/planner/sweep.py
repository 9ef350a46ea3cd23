"""Expand a sweep file (sizes x variants x token budgets x seeds) into validated runs.

    from cqk_megatron.planner.sweep import expand_sweep

    runs = expand_sweep("configs/sweeps/ladder.yaml")
    # [{"name": "ladder-1b-coupled-s0", "config": ".../configs/models/1b.yaml",
    #   "overrides": ["name=ladder-1b-coupled-s0", "seed=0", ...],
    #   "resources": {"nodes": 4, "gpus_per_node": 8, ...},
    #   "schedule": {"tokens": ..., "train_steps": ..., "lr": ..., ...},
    #   "pending": []}, ...]

The schema is documented at the top of ``configs/sweeps/ladder.yaml``. Every run is
planned by ``planner.runs.plan_config`` (the config file with the run's overrides, checked
by ``validate`` on ``world_size=nodes * gpus_per_node``) here, so an impossible layout
fails before anything is submitted. Run names are deterministic: ``{name}-{size}-{variant}
[-t{tokens per param}]-s{seed}`` (the budget part only when a size has several budgets).
A variant is a preset of the registry (``variants.VARIANTS``): its coupling and scoring
become the ``attention.coupling`` / ``attention.scoring`` overrides
(``planner.runs.variant_overrides``), so a preset registered from code needs no file under
``configs/variants/``. A size's token budget in tokens per parameter is read against its
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
from pathlib import Path

import yaml

from cqk_megatron.config import (
    CONFIGS_DIR,
    VARIANTS,
    ConfigError,
    RunConfig,
    load_config,
)
from cqk_megatron.planner.parameters import count_parameters
from cqk_megatron.planner.runs import plan_config, run_overrides

# schedule key -> config field that the training engine reads
SCHEDULE_FIELDS = {
    "lr": "train.lr",
    "min_lr": "train.min_lr",
    "train_steps": "train.train_steps",
    "warmup_steps": "train.warmup_steps",
    "eval_interval": "train.eval_interval",
}
LAYOUT_KEYS = ("tensor_parallel", "pipeline_parallel", "nodes", "gpus_per_node")
SIZE_KEYS = {
    "model",
    "lr",
    "global_batch_size",
    "micro_batch_size",
    "layout",
    "resources",
    "seeds",
    "tokens_per_param",
    "tokens",
    "overrides",
    "variants",
}
TOP_KEYS = {"name", "variants", "seeds", "tokens_per_param", "common", "schedule", "sizes"}


def _fail(path: Path, message: str) -> ConfigError:
    return ConfigError(f"{path}: {message}")


def _as_list(value, default):
    if value is None:
        return list(default)
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
    raise _fail(path, f"model file '{model}' not found next to the sweep or under {CONFIGS_DIR}")


_TOTALS: dict[str, int] = {}


def standard_parameters(model_path: Path, overrides: list[str]) -> int:
    """Total parameters of the size's model with standard attention, counted without
    building it or starting a process group."""
    key = repr((str(model_path), overrides))
    if key not in _TOTALS:
        _TOTALS[key] = count_parameters(load_config(model_path, overrides), "standard")
    return _TOTALS[key]


def expand_sweep(path: str | Path) -> list[dict]:
    """Every run of the sweep, validated; see the module docstring for the shape."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file '{path}' does not exist")
    try:
        sweep = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise _fail(path, f"not valid YAML: {error}") from error
    unknown = set(sweep) - TOP_KEYS
    if unknown:
        raise _fail(path, f"unknown top-level keys {sorted(unknown)}; allowed: {sorted(TOP_KEYS)}")
    if not isinstance(sweep.get("sizes"), dict) or not sweep["sizes"]:
        raise _fail(path, "'sizes' must map size names (e.g. 1b) to their settings")
    sweep_name = sweep.get("name", path.stem)
    common = {str(k): v for k, v in (sweep.get("common") or {}).items()}
    schedule_defaults = sweep.get("schedule") or {}

    runs, names = [], set()
    for size, spec in sweep["sizes"].items():
        where = f"sizes.{size}"
        if not isinstance(spec, dict):
            raise _fail(path, f"'{where}' must be a mapping")
        unknown = set(spec) - SIZE_KEYS
        if unknown:
            raise _fail(
                path, f"'{where}': unknown keys {sorted(unknown)}; allowed: {sorted(SIZE_KEYS)}"
            )
        for key in ("model", "lr", "global_batch_size", "micro_batch_size", "layout"):
            if key not in spec:
                raise _fail(path, f"'{where}.{key}' is required")
        layout = spec["layout"]
        missing = [k for k in LAYOUT_KEYS if k not in (layout or {})]
        if missing:
            raise _fail(path, f"'{where}.layout' lacks {missing}")
        model_path = _resolve_model(path, spec["model"])
        size_overrides = [_override(k, v) for k, v in (spec.get("overrides") or {}).items()]
        variants = _as_list(spec.get("variants"), _as_list(sweep.get("variants"), ["standard"]))
        bad = [v for v in variants if v not in VARIANTS]
        if bad:
            raise _fail(path, f"'{where}': unknown variants {bad}; choose from {list(VARIANTS)}")
        seeds = _as_list(spec.get("seeds"), _as_list(sweep.get("seeds"), [0]))
        budgets = _as_list(
            spec.get("tokens_per_param"), _as_list(sweep.get("tokens_per_param"), [20])
        )
        seq_length = load_config(model_path, size_overrides).model.seq_length
        tokens_per_step = spec["global_batch_size"] * seq_length
        params = None if "tokens" in spec else standard_parameters(model_path, size_overrides)
        world_size = layout["nodes"] * layout["gpus_per_node"]

        for budget in budgets:
            tokens = int(spec["tokens"]) if "tokens" in spec else int(budget * params)
            train_steps = math.ceil(tokens / tokens_per_step)
            schedule = {
                "tokens": tokens,
                "tokens_per_param": None if params is None else tokens / params,
                "train_steps": train_steps,
                "lr": float(spec["lr"]),
                "min_lr": float(spec["lr"]) * float(schedule_defaults.get("min_lr_ratio", 0.1)),
                "warmup_steps": max(
                    1, round(float(schedule_defaults.get("warmup_fraction", 0.01)) * train_steps)
                ),
                "eval_interval": max(
                    1, round(float(schedule_defaults.get("eval_fraction", 0.05)) * train_steps)
                ),
            }
            for variant in variants:
                for seed in seeds:
                    budget_part = f"-t{budget:g}" if len(budgets) > 1 else ""
                    name = f"{sweep_name}-{size}-{variant}{budget_part}-s{seed}"
                    if name in names:
                        raise _fail(path, f"two runs are named '{name}'; make sizes unique")
                    names.add(name)
                    runs.append(
                        _make_run(
                            path,
                            name,
                            model_path,
                            variant,
                            seed,
                            spec,
                            layout,
                            common,
                            size_overrides,
                            schedule,
                            world_size,
                            tokens_per_step,
                        )
                    )
    return runs


def _make_run(
    path,
    name,
    model_path,
    variant,
    seed,
    spec,
    layout,
    common,
    size_overrides,
    schedule,
    world_size,
    tokens_per_step,
) -> dict:
    # the registry's preset (not configs/variants/*.yaml), through the planner
    rest = [_override(k, v) for k, v in common.items()]
    rest += size_overrides
    rest += [
        f"parallel.tensor_parallel={layout['tensor_parallel']}",
        f"parallel.pipeline_parallel={layout['pipeline_parallel']}",
        f"train.global_batch_size={spec['global_batch_size']}",
        f"train.micro_batch_size={spec['micro_batch_size']}",
    ]
    pending = []
    for key, dotted in SCHEDULE_FIELDS.items():
        if _has_field(dotted):
            rest.append(_override(dotted, schedule[key]))
        else:
            pending.append(dotted)
    try:
        plan_config(
            model_path, variant, name=name, seed=seed, overrides=rest, world_size=world_size
        )
    except ConfigError as error:
        raise _fail(path, f"run '{name}' (world size {world_size}): {error}") from error
    overrides = run_overrides(variant, name, seed, rest)
    tp, pp = layout["tensor_parallel"], layout["pipeline_parallel"]
    resources = {
        **(spec.get("resources") or {}),
        "nodes": layout["nodes"],
        "gpus_per_node": layout["gpus_per_node"],
        "tensor_parallel": tp,
        "pipeline_parallel": pp,
        "data_parallel": world_size // (tp * pp),
        "world_size": world_size,
    }
    return {
        "name": name,
        "config": str(model_path),
        "overrides": overrides,
        "resources": resources,
        "schedule": {**schedule, "tokens_per_step": tokens_per_step},
        "pending": pending,
    }
