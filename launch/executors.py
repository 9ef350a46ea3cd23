"""submitit executors for a cluster, and the sbatch script they write.

``--cluster`` is always explicit: submitit's ``AutoExecutor`` picks Slurm whenever
``srun`` is on PATH, which is a guess we do not make.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import submitit
from submitit.slurm import slurm as submitit_slurm

from launch import attempts
from launch.container import IMAGE_PYTHON, batch_python, task_python
from launch.local_job import LocalExecutor
from launch.resources import (
    ClusterProfile,
    Resources,
    sbatch_parameters,
    setup_lines,
    time_minutes,
)

REPO = Path(__file__).resolve().parent.parent


def job_python(profile: ClusterProfile) -> str:
    """The python that runs the job: the profile's, the image's, or the submitting one."""
    if profile.python:
        return profile.python
    return IMAGE_PYTHON if profile.container is not None else shlex.quote(sys.executable)


def _gpus(resources: Resources) -> bool:
    return resources.gpus_per_node > 0


def task_command_python(profile: ClusterProfile, resources: Resources) -> str:
    """What starts each task's python (inside the profile's container, if any)."""
    return task_python(profile.container, job_python(profile), _gpus(resources))


def slurm_parameters(
    folder: Path, profile: ClusterProfile, resources: Resources, job_name: str
) -> dict:
    """sbatch_parameters, and the batch script's lines around srun that make a failed
    attempt relaunch itself (launch/attempts.py): a marker before, the teardown after."""
    params = sbatch_parameters(profile, resources, REPO, job_name)
    params["setup"] = [
        *params["setup"],
        f'echo "{attempts.MARKER} ${{SLURM_RESTART_COUNT:-0}} on $(hostname)" >&2',
    ]
    python = batch_python(profile.container, job_python(profile), _gpus(resources))
    params["teardown"] = attempts.teardown_lines(python, folder)
    return params


def slurm_executor(
    folder: Path, profile: ClusterProfile, resources: Resources, job_name: str
) -> submitit.SlurmExecutor:
    executor = submitit.SlurmExecutor(
        folder=folder,
        max_num_timeout=resources.max_requeues,
        python=task_command_python(profile, resources),
    )
    executor.update_parameters(**slurm_parameters(folder, profile, resources, job_name))
    return executor


def local_executor(
    folder: Path, profile: ClusterProfile, resources: Resources, run_dir: Path | None = None
) -> submitit.LocalExecutor:
    """submitit's local executor with one controller (launch/local_job.py): its job id
    ends every process of the job, and it ends a failed attempt's tasks and relaunches it."""
    executor = LocalExecutor(
        folder=folder,
        run_dir=run_dir or folder.parent,
        policy=attempts.Policy(resources.max_restarts, resources.max_identical_failures),
        max_num_timeout=resources.max_requeues,
        python=job_python(profile),
    )
    executor.update_parameters(
        nodes=1,
        tasks_per_node=resources.tasks,
        gpus_per_node=resources.gpus_per_node,
        timeout_min=time_minutes(resources.time),
        signal_delay_s=resources.signal_delay_s,
        setup=setup_lines(profile, resources, REPO),
    )
    return executor


def sbatch_script(
    folder: Path,
    profile: ClusterProfile,
    resources: Resources,
    job_name: str,
    array_size: int | None = None,
) -> str:
    """The sbatch file ``slurm_executor(...)`` would write, without needing Slurm here.

    Uses submitit's own renderer (``submitit.slurm.slurm._make_sbatch_string``, private:
    submitit is pinned), so a dry run shows exactly what would be submitted.
    """
    params = slurm_parameters(folder, profile, resources, job_name)
    if array_size is not None and array_size > 1:
        params["map_count"] = array_size
    command = " ".join(
        [
            task_command_python(profile, resources),
            "-u -m submitit.core._submit",
            shlex.quote(str(folder)),
        ]
    )
    return submitit_slurm._make_sbatch_string(command=command, folder=folder, **params)
