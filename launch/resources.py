"""What a job asks the cluster for: cluster profiles, resources and their sbatch form.

A cluster profile (``configs/clusters/*.yaml``) gives defaults for one cluster: whether
its nodes have GPUs, partition, account, time, the shell lines that prepare a job
(``setup``), environment variables (``env``), flags for srun (``srun_args``), a container
to run the tasks in (``container``, ``launch/container.py``) and so on. Resources are
resolved from, in order of precedence: command-line options, the sweep's per-size
``resources``/``layout``, the profile, and the defaults below. On GPU nodes there is one
task per GPU; on CPU nodes ``tasks_per_node`` says how many processes each node runs.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cqk_megatron.config import ConfigError, from_dict, read_yaml

# The launch backends' names as registered at each use (launch.backends.register_backend).
from launch.backends.registry import BACKEND_NAMES as CLUSTERS
from launch.container import Container, check_container, srun_container_args

# Resource keys a sweep's layout carries for information only (checked by the sweep).
SWEEP_INFO_KEYS = {"tensor_parallel", "pipeline_parallel", "data_parallel", "world_size"}


@dataclass
class Resources:
    """One job's request. ``None`` leaves the choice to the cluster's defaults."""

    nodes: int | None = None  # None: parallel.world_size / tasks per node, else 1
    gpus_per_node: int = 0  # one task per GPU; 0 on CPU nodes
    tasks_per_node: int = 1  # CPU nodes only
    cpus_per_task: int | None = None
    mem: str | None = None  # Slurm syntax per node: 64G, 500000M, 0 (all of it)
    time: str = "01:00:00"  # Slurm syntax: minutes, HH:MM:SS, D-HH:MM:SS
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    job_name: str | None = None
    slurm_args: dict[str, str] = field(default_factory=dict)  # any other #SBATCH option
    srun_args: list[str] = field(default_factory=list)
    signal_delay_s: int = 120  # the warning signal (USR1) comes this long before the limit
    max_requeues: int = 10  # the job requeues itself at most this many times
    # launch/attempts.py: a failed attempt (a rank died, hung or crashed) is relaunched
    # from the newest complete checkpoint at most max_restarts times, and not again once
    # the last max_identical_failures attempts failed the same way (rank, exit, step).
    max_restarts: int = 3
    max_identical_failures: int = 2
    array_parallelism: int = 16  # sweeps: array tasks running at once

    @property
    def tasks(self) -> int:
        """Tasks (processes) per node."""
        return self.gpus_per_node if self.gpus_per_node > 0 else self.tasks_per_node

    @property
    def world_size(self) -> int:
        return (self.nodes or 1) * self.tasks


@dataclass
class ClusterProfile:
    """Defaults and job preparation for one cluster (``configs/clusters/NAME.yaml``)."""

    source: str = "built-in defaults"
    cluster: str | None = None  # slurm | local; None: the command line must say
    gpus: bool = False  # nodes have GPUs (one task per GPU) or not (tasks_per_node)
    python: str | None = None  # the job's python; None: the submitting interpreter
    runs_root: str | None = None  # log.root for runs submitted with this profile
    setup: list[str] = field(default_factory=list)  # shell lines run before srun
    env: dict[str, str] = field(default_factory=dict)  # exported before srun
    container: Container | None = None  # run the tasks in an image (launch/container.py)
    resources: Resources = field(default_factory=Resources)


_PROFILE_KEYS = {f.name for f in dataclasses.fields(ClusterProfile)} - {"source", "resources"}
# Blocks of a profile that other readers own: the GPU figures of the step-time model
# (``cqk_megatron.planner.hardware``).
_PLANNER_KEYS = {"hardware"}
_RESOURCE_KEYS = {f.name for f in dataclasses.fields(Resources)}
# Whole-number resources and their least values (the rest start at 1).
_AT_LEAST_ZERO = ("gpus_per_node", "max_restarts")


def _check_ranges(resources: Resources, keys: set[str], where: str) -> None:
    """The bounds of the given (already typed) resource values."""
    for key in sorted(keys):
        value = getattr(resources, key)
        if isinstance(value, int) and not isinstance(value, bool):
            low = 0 if key in _AT_LEAST_ZERO else 1
            if value < low:
                raise ConfigError(f"{where}: '{key}' must be at least {low}, got {value}")
    if "time" in keys:
        time_minutes(resources.time, where)


def _as_strings(values: dict[str, Any]) -> dict[str, Any]:
    """Slurm's values as the text they stand for (``time: 90``, ``mem: 0``, an sbatch
    option's number); what they mean is checked on the text."""
    values = dict(values)
    for key in ("time", "mem"):
        if key in values:
            values[key] = str(values[key])
    if isinstance(values.get("slurm_args"), dict):
        values["slurm_args"] = {str(k): str(v) for k, v in values["slurm_args"].items()}
    return values


def merge_resources(base: Resources, values: dict[str, Any], where: str) -> Resources:
    """``base`` with ``values`` (resource keys, ``None`` meaning unset) laid over it, typed
    as ``Resources`` declares them (``config.from_dict``)."""
    unknown = set(values) - _RESOURCE_KEYS
    if unknown:
        raise ConfigError(
            f"{where}: unknown resource keys {sorted(unknown)}; known: {sorted(_RESOURCE_KEYS)}"
        )
    updates = _as_strings({k: v for k, v in values.items() if v is not None})
    typed = from_dict(Resources, updates, where)
    _check_ranges(typed, set(updates), where)
    updates = {key: getattr(typed, key) for key in updates}
    if "slurm_args" in updates:
        updates["slurm_args"] = {**base.slurm_args, **updates["slurm_args"]}
    return dataclasses.replace(base, **updates)


def load_profile(path: str | Path | None) -> ClusterProfile:
    """Read a cluster profile (``config.read_yaml``, typed by ``config.from_dict``);
    ``None`` gives the built-in defaults."""
    if path is None:
        return ClusterProfile()
    data = read_yaml(path, "cluster profile", "see configs/clusters/")
    for key in _PLANNER_KEYS:
        data.pop(key, None)
    unknown = sorted(set(data) - _PROFILE_KEYS - _RESOURCE_KEYS)
    if unknown:
        known = sorted(_PROFILE_KEYS | _RESOURCE_KEYS | _PLANNER_KEYS)
        raise ConfigError(f"{path}: unknown keys {unknown}; known: {known}")
    values = {k: data.pop(k) for k in list(data) if k in _PROFILE_KEYS}
    if isinstance(values.get("env"), dict):  # exported as text: OMP_NUM_THREADS: 8 is "8"
        values["env"] = {str(k): str(v) for k, v in values["env"].items()}
    profile = from_dict(ClusterProfile, values, str(path))
    if profile.container is not None:
        check_container(profile.container, str(path))
    if profile.cluster is not None and profile.cluster not in CLUSTERS:
        raise ConfigError(
            f"{path}: cluster={profile.cluster!r} is unknown; use one of {list(CLUSTERS)}"
        )
    resources = merge_resources(Resources(), data, str(path))
    return dataclasses.replace(profile, source=str(path), resources=resources)


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def time_minutes(value: str | int, where: str = "time") -> int:
    """Slurm's time syntax in whole minutes (rounded up): 90, 1:30:00, 2-00:00:00."""
    text = str(value).strip()
    match = _TIME.match(text)
    if not match:
        raise ConfigError(
            f"{where}: time={value!r} is not Slurm's syntax; use minutes (90), HH:MM:SS "
            "(01:30:00) or D-HH:MM:SS (2-00:00:00)"
        )
    days, a, b, c = (int(x) if x else None for x in match.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # HH:MM:SS
        seconds = a * 3600 + b * 60 + c
    elif b is not None:  # MM:SS
        seconds = a * 60 + b
    else:  # MM
        seconds = a * 60
    minutes = -(-seconds // 60)
    if minutes < 1:
        raise ConfigError(f"{where}: time={value!r} must be at least one minute")
    return minutes


def parse_key_values(items: list[str], option: str) -> dict[str, str]:
    """``["key=value", ...]`` from a repeated command-line option."""
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{option} {item!r} must look like key=value, e.g. mail-type=END")
        pairs[key.strip()] = value
    return pairs


def job_environment(profile: ClusterProfile, resources: Resources) -> dict[str, str]:
    """Variables every task needs, the profile's last (it may override them)."""
    env = {}
    if resources.gpus_per_node == 0:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator: no GPU on the node
        # One rank per core: torch's default (every core per process) oversubscribes.
        env["OMP_NUM_THREADS"] = str(resources.cpus_per_task or 1)
    env["SUBMITIT_PREEMPT_SIGNAL"] = "USR1"  # the signal the training loop checkpoints on
    env.update(profile.env)
    return env


def setup_lines(profile: ClusterProfile, resources: Resources, repo: Path) -> list[str]:
    """Shell lines before ``srun``: the profile's, then exports (so the job imports this
    checkout's ``launch`` and ``cqk_megatron`` whatever is installed)."""
    lines = list(profile.setup)
    lines.append(f"export PYTHONPATH={shlex.quote(str(repo))}${{PYTHONPATH:+:$PYTHONPATH}}")
    for key, value in job_environment(profile, resources).items():
        lines.append(f"export {key}={shlex.quote(value)}")
    return lines


def sbatch_parameters(
    profile: ClusterProfile, resources: Resources, repo: Path, job_name: str
) -> dict[str, Any]:
    """submitit ``SlurmExecutor`` parameters (the names of its ``update_parameters``)."""
    r = resources
    params: dict[str, Any] = {
        "job_name": r.job_name or job_name,
        "nodes": r.nodes or 1,
        "ntasks_per_node": r.tasks,
        "time": time_minutes(r.time),
        "signal_delay_s": r.signal_delay_s,
        "setup": setup_lines(profile, r, repo),
        "array_parallelism": r.array_parallelism,
    }
    if r.gpus_per_node > 0:
        params["gpus_per_node"] = r.gpus_per_node
    optional = {
        "cpus_per_task": r.cpus_per_task,
        "mem": r.mem,
        "partition": r.partition,
        "account": r.account,
        "qos": r.qos,
        "constraint": r.constraint,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    if r.exclusive:
        params["exclusive"] = True
    # One task's failure ends the job step at once: no task waits for a dead or stuck one
    # (the batch script's teardown then records the attempt and requeues it).
    container = srun_container_args(profile.container)
    params["srun_args"] = ["--kill-on-bad-exit=1", *container, *r.srun_args]
    # USR1 (not submitit's default USR2) is the signal the training loop saves on; requeue
    # is explicit so that clusters with JobRequeue=0 still let the job requeue itself.
    extra = {"signal": f"USR1@{r.signal_delay_s}", "requeue": True}
    extra.update(r.slurm_args)
    params["additional_parameters"] = extra
    return params
