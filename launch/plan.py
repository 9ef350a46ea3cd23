"""From a run config (or a sweep) and the command line to validated runs with resources.

Nothing here submits or writes: a plan that does not validate fails before any job exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cqk_megatron.config import ConfigError, RunConfig, load_config, validate
from launch.backends import get_backend
from launch.resources import (
    SWEEP_INFO_KEYS,
    ClusterProfile,
    Resources,
    merge_resources,
)


@dataclass
class RunPlan:
    config: RunConfig  # validated for resources.world_size, log.root absolute
    resources: Resources  # nodes resolved

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def run_dir(self) -> Path:
        return Path(self.config.log.root) / self.config.name

    def layout(self) -> str:
        p, r = self.config.parallel, self.resources
        world = r.world_size
        tp, pp = p.tensor_parallel, p.pipeline_parallel
        per_node = f"{r.gpus_per_node} GPUs" if r.gpus_per_node else f"{r.tasks} CPU tasks"
        return (
            f"TP {tp} x PP {pp} x DP {p.data_parallel(world)} = world size {world} "
            f"({r.nodes} node{'s' if r.nodes != 1 else ''} x {per_node}, one task each)"
        )


def _load(config_path: str | Path, overrides: list[str], profile: ClusterProfile) -> RunConfig:
    # The profile's runs root comes first so that a log.root=... on the command line wins.
    root = [f"log.root={profile.runs_root}"] if profile.runs_root else []
    config = load_config(config_path, [*root, *overrides])
    absolute = Path(config.log.root).expanduser().resolve()
    return dataclasses.replace(config, log=dataclasses.replace(config.log, root=str(absolute)))


def resolve(config: RunConfig, resources: Resources, cluster: str) -> RunPlan:
    """Fill in the node count, check it against the config and the launch backend called
    ``cluster``, and validate the layout."""
    tasks = resources.tasks
    declared = config.parallel.world_size
    nodes = resources.nodes
    if nodes is None:
        nodes = declared // tasks if declared and declared % tasks == 0 else 1
    resources = dataclasses.replace(resources, nodes=nodes)
    world = resources.world_size
    if declared is not None and declared != world:
        raise ConfigError(
            f"run '{config.name}': parallel.world_size={declared} but the job has {world} "
            f"tasks ({nodes} nodes x {tasks}); change --nodes/--gpus-per-node/--tasks or "
            "the config"
        )
    get_backend(cluster).check_resources(resources)
    try:
        validate(config, world_size=world)
    except ConfigError as error:
        raise ConfigError(
            f"run '{config.name}' with {nodes} node(s) x {tasks} task(s) = world size {world}: "
            f"{error}"
        ) from error
    return RunPlan(config=config, resources=resources)


def plan_run(
    config_path: str | Path,
    overrides: list[str],
    profile: ClusterProfile,
    cli_resources: dict[str, Any],
    cluster: str,
) -> RunPlan:
    config = _load(config_path, overrides, profile)
    resources = merge_resources(profile.resources, cli_resources, "command line")
    return resolve(config, resources, cluster)


def _sweep_resources(run: dict, profile: ClusterProfile, where: str) -> dict[str, Any]:
    """A sweep run's resources in launcher terms (its layout's GPUs become CPU tasks on a
    cluster without GPUs)."""
    values = {k: v for k, v in run["resources"].items() if k not in SWEEP_INFO_KEYS}
    if not profile.gpus and values.get("gpus_per_node"):
        values["tasks_per_node"] = values.pop("gpus_per_node")
        values["gpus_per_node"] = 0
    return values


def plan_sweep(
    sweep_path: str | Path,
    overrides: list[str],
    profile: ClusterProfile,
    cli_resources: dict[str, Any],
    cluster: str,
) -> list[RunPlan]:
    from cqk_megatron.planner.sweep import expand_sweep

    plans = []
    for run in expand_sweep(sweep_path):
        where = f"{sweep_path} run '{run['name']}'"
        config = _load(run["config"], [*run["overrides"], *overrides], profile)
        resources = merge_resources(profile.resources, _sweep_resources(run, profile, where), where)
        resources = merge_resources(resources, cli_resources, "command line")
        plans.append(resolve(config, resources, cluster))
    names = [p.name for p in plans]
    if len(set(names)) != len(names):
        raise ConfigError(f"{sweep_path}: run names repeat after the overrides ({names})")
    return plans
