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

from launch.resources import (
    ClusterProfile,
    Resources,
    sbatch_parameters,
    setup_lines,
    time_minutes,
)

REPO = Path(__file__).resolve().parent.parent


def job_python(profile: ClusterProfile) -> str:
    return profile.python or shlex.quote(sys.executable)


def slurm_executor(
    folder: Path, profile: ClusterProfile, resources: Resources, job_name: str
) -> submitit.SlurmExecutor:
    executor = submitit.SlurmExecutor(
        folder=folder, max_num_timeout=resources.max_requeues, python=job_python(profile)
    )
    executor.update_parameters(**sbatch_parameters(profile, resources, REPO, job_name))
    return executor


def local_executor(
    folder: Path, profile: ClusterProfile, resources: Resources
) -> submitit.LocalExecutor:
    from launch.local_job import LocalExecutor  # its job id ends every process of the job

    executor = LocalExecutor(
        folder=folder, max_num_timeout=resources.max_requeues, python=job_python(profile)
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
    params = sbatch_parameters(profile, resources, REPO, job_name)
    if array_size is not None and array_size > 1:
        params["map_count"] = array_size
    command = " ".join(
        [job_python(profile), "-u -m submitit.core._submit", shlex.quote(str(folder))]
    )
    return submitit_slurm._make_sbatch_string(command=command, folder=folder, **params)
