"""From a run config (or a sweep) and the command line to validated runs with resources.

Nothing here submits or writes: a run that does not validate fails before any job exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cqk_megatron.config import (
    COMMAND_LINE,
    ConfigError,
    RunConfig,
    TracedConfig,
    explain_config,
    load_config_traced,
    validate,
)
from launch.backends import get_backend
from launch.resources import (
    SWEEP_INFO_KEYS,
    ClusterProfile,
    Resources,
    merge_resources,
)


@dataclass
class RunSpec:
    """One run as the launcher submits it: its validated config and its job's resources."""

    config: RunConfig  # validated for resources.world_size, log.root absolute
    resources: Resources  # nodes resolved
    # where each value that is not the default was set (config.load_config_traced), with
    # log.root's as runs_root decided
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def run_dir(self) -> Path:
        return Path(self.config.log.root) / self.config.name

    @property
    def traced(self) -> TracedConfig:
        return TracedConfig(self.config, self.sources)

    def folder_line(self) -> str:
        """The run folder and why it is there (``runs_root``'s rule)."""
        return f"{self.run_dir} (log.root from {self.sources.get('log.root', 'the default')})"

    def layout(self) -> str:
        p, r = self.config.parallel, self.resources
        world = r.world_size
        tp, pp = p.tensor_parallel, p.pipeline_parallel
        per_node = f"{r.gpus_per_node} GPUs" if r.gpus_per_node else f"{r.tasks} CPU tasks"
        return (
            f"TP {tp} x PP {pp} x DP {p.data_parallel(world)} = world size {world} "
            f"({r.nodes} node{'s' if r.nodes != 1 else ''} x {per_node}, one task each)"
        )


def explained_configs(specs: list[RunSpec]) -> str:
    """``--print-config``: each run's config, every value that is not the default with
    where it was set (``config.explain_config``), under a line naming its folder."""
    return "\n".join(
        explain_config(p.traced, f"run {p.name}: run folder {p.folder_line()}") for p in specs
    )


Overrides = Sequence[tuple[str, Sequence[str]]]  # (where, ["key=value", ...]), in order


def runs_root(
    traced: TracedConfig, profile: ClusterProfile, overrides: Overrides
) -> tuple[str, str]:
    """Where a submitted run's folder goes: the one rule (docs/launcher.md, "Where a run's
    folder is"). ``log.root`` set by an override (the command line's ``log.root=...``, a
    sweep's) wins; else the cluster profile's ``runs_root``; else the run config's
    ``log.root`` (its files', or the default ``runs``). A relative root is taken from the
    directory the launcher runs in. Returns the absolute root and where it came from."""
    where = traced.sources.get("log.root", "the default")
    root = traced.config.log.root
    if profile.runs_root and where not in {label for label, _ in overrides}:
        root, where = profile.runs_root, f"cluster profile {profile.source} (runs_root)"
    return str(Path(root).expanduser().resolve()), where


def _load(config_path: str | Path, overrides: Overrides, profile: ClusterProfile) -> TracedConfig:
    traced = load_config_traced(config_path, overrides)
    root, where = runs_root(traced, profile, overrides)
    log = dataclasses.replace(traced.config.log, root=root)
    return TracedConfig(
        dataclasses.replace(traced.config, log=log), {**traced.sources, "log.root": where}
    )


def resolve(
    config: RunConfig,
    resources: Resources,
    cluster: str,
    sources: dict[str, str] | None = None,
) -> RunSpec:
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
    return RunSpec(config=config, resources=resources, sources=sources or {})


def resolve_run(
    config_path: str | Path,
    overrides: list[str],
    profile: ClusterProfile,
    cli_resources: dict[str, Any],
    cluster: str,
) -> RunSpec:
    traced = _load(config_path, [(COMMAND_LINE, overrides)], profile)
    resources = merge_resources(profile.resources, cli_resources, COMMAND_LINE)
    return resolve(traced.config, resources, cluster, traced.sources)


def _sweep_resources(run: dict, profile: ClusterProfile, where: str) -> dict[str, Any]:
    """A sweep run's resources in launcher terms (its layout's GPUs become CPU tasks on a
    cluster without GPUs)."""
    values = {k: v for k, v in run["resources"].items() if k not in SWEEP_INFO_KEYS}
    if not profile.gpus and values.get("gpus_per_node"):
        values["tasks_per_node"] = values.pop("gpus_per_node")
        values["gpus_per_node"] = 0
    return values


def resolve_sweep(
    sweep_path: str | Path,
    overrides: list[str],
    profile: ClusterProfile,
    cli_resources: dict[str, Any],
    cluster: str,
) -> list[RunSpec]:
    from cqk_megatron.planner.sweep import expand_sweep

    specs = []
    for run in expand_sweep(sweep_path):
        where = f"{sweep_path} run '{run['name']}'"
        groups = [(where, run["overrides"]), (COMMAND_LINE, overrides)]
        traced = _load(run["config"], groups, profile)
        resources = merge_resources(profile.resources, _sweep_resources(run, profile, where), where)
        resources = merge_resources(resources, cli_resources, COMMAND_LINE)
        specs.append(resolve(traced.config, resources, cluster, traced.sources))
    names = [p.name for p in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"{sweep_path}: run names repeat after the overrides ({names})")
    return specs
