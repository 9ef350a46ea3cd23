"""``cqk submit --emit-sbatch DIR``: plain sbatch scripts that a site's admin can read and
submit by hand (``sbatch DIR/RUN.sbatch``), one per run, beside the resolved config each
one trains (``DIR/RUN.yaml``).

The script asks for what the submission would (the same ``#SBATCH`` options, setup lines,
exports, srun flags and container) and starts the ranks with plain ``srun`` running ``cqk
train`` (``python -m cqk_megatron.train``), which reads its rank and world from srun's
variables. What the launcher adds around a job is left out, and said in the script: a
failed attempt is not relaunched (submit the script again: the run resumes from its
newest complete checkpoint), and a job stopped by the time limit's signal requeues itself
with ``scontrol requeue`` after it saved (exit 75). ``DIR`` must be on a filesystem that
every node mounts.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import yaml

from cqk_megatron.config import to_dict
from cqk_megatron.errors import EXIT_REQUEUE
from launch.container import task_python
from launch.executors import REPO, job_python
from launch.resolve import RunSpec
from launch.resources import ClusterProfile, sbatch_parameters

# submitit's parameter names -> sbatch's options, in the order a reader expects them.
_OPTIONS = (
    ("job_name", "job-name"),
    ("partition", "partition"),
    ("account", "account"),
    ("qos", "qos"),
    ("nodes", "nodes"),
    ("ntasks_per_node", "ntasks-per-node"),
    ("gpus_per_node", "gpus-per-node"),
    ("cpus_per_task", "cpus-per-task"),
    ("mem", "mem"),
    ("constraint", "constraint"),
)


def sbatch_options(params: dict, time: str, output: Path) -> list[str]:
    lines = [f"#SBATCH --{flag}={params[key]}" for key, flag in _OPTIONS if key in params]
    lines.append(f"#SBATCH --time={time}")
    if params.get("exclusive"):
        lines.append("#SBATCH --exclusive")
    for key, value in params["additional_parameters"].items():
        flag = key.replace("_", "-")
        lines.append(f"#SBATCH --{flag}" if value is True else f"#SBATCH --{flag}={value}")
    lines.append(f"#SBATCH --output={output}")
    return lines


def script_text(spec: RunSpec, profile: ClusterProfile, config_path: Path) -> str:
    """The sbatch script of ``spec``, training the config written at ``config_path``."""
    r = spec.resources
    params = sbatch_parameters(profile, r, REPO, spec.name)
    python = task_python(profile.container, job_python(profile), r.gpus_per_node > 0)
    srun = ["srun", *params["srun_args"]]
    train = f"{python} -u -m cqk_megatron.train --config {shlex.quote(str(config_path))}"
    output = config_path.parent / f"{spec.name}-%j.out"
    lines = [
        "#!/bin/bash",
        f"# Run '{spec.name}' ({spec.layout()}) in {spec.run_dir}.",
        "# Written by cqk submit --emit-sbatch; submit it with: sbatch "
        + shlex.quote(str(config_path.with_suffix(".sbatch"))),
        "# A failed attempt is not relaunched here: submit this script again and the run",
        "# resumes from its newest complete checkpoint (cqk status RUN shows where it stands).",
        *sbatch_options(params, r.time, output),
        "",
        "# The site's setup and the job's environment (from the cluster profile).",
        *params["setup"],
        "# Relative data paths in the config read from where the submission was prepared.",
        f"cd {shlex.quote(os.getcwd())}",
        "",
        " ".join(shlex.quote(w) for w in srun) + " " + train,
        "code=$?",
        f"# {EXIT_REQUEUE}: stopped by the time limit's signal after saving a checkpoint.",
        f'if [ "$code" -eq {EXIT_REQUEUE} ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def emit(specs: list[RunSpec], profile: ClusterProfile, folder: Path) -> list[Path]:
    """Write ``RUN.yaml`` and ``RUN.sbatch`` in ``folder`` for each spec; the scripts."""
    folder = Path(folder).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for spec in specs:
        config_path = folder / f"{spec.name}.yaml"
        config_path.write_text(yaml.safe_dump(to_dict(spec.config), sort_keys=False))
        script = folder / f"{spec.name}.sbatch"
        script.write_text(script_text(spec, profile, config_path))
        written.append(script)
    return written
