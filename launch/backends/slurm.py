"""The ``slurm`` backend: sbatch through submitit; the scheduler owns the jobs.

A job's tasks are started by ``srun`` on the nodes Slurm gives it; its state comes from
Slurm's accounting or its controller (``launch/slurm_state.py``); ``scancel`` ends it;
the job requeues itself with ``scontrol requeue`` (``SLURM_RESTART_COUNT`` numbers the
attempts). A launcher that ends leaves its jobs queued.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import submitit

from cqk_megatron.errors import EXIT_REQUEUE
from launch import slurm_state
from launch.backends.base import Backend
from launch.executors import sbatch_script, slurm_executor

if TYPE_CHECKING:
    from launch.resolve import RunSpec
    from launch.resources import ClusterProfile, Resources


class SlurmBackend(Backend):
    """A Slurm cluster: jobs (one job array for the runs of a sweep that share resources)
    queued with sbatch, followed with sacct/scontrol, ended with scancel."""

    launcher_owns_jobs = False
    job_arrays = True
    sbatch_scripts = True

    def submission_notes(self) -> list[str]:
        if "SLURM_CONF" in os.environ:
            return []
        return ["SLURM_CONF is not set; sbatch uses its default configuration"]

    def executor(
        self,
        folder: Path,
        profile: ClusterProfile,
        resources: Resources,
        job_name: str,
        run_dir: Path,
    ) -> submitit.Executor:
        return slurm_executor(folder, profile, resources, job_name)

    def dry_run(
        self, groups: list[tuple[list[RunSpec], Path, str]], profile: ClusterProfile, array: bool
    ) -> list[str]:
        out = []
        for specs, folder, job_name in groups:
            names = ", ".join(p.name for p in specs)
            kind = f"job array of {len(specs)}" if array else "job"
            out.append(f"==> sbatch script ({kind}: {names}; submitit folder {folder})")
            script = sbatch_script(folder, profile, specs[0].resources, job_name, len(specs))
            out.append(script.rstrip())
        return out

    def job_state(self, job_id: str) -> str:
        return slurm_state.slurm_states([job_id])[job_id]

    def cancel(self, job_id: str) -> str:
        out = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"scancel {job_id} failed: {out.stderr.strip()}")
        return f"scancel {job_id}"

    def rendezvous_address(self, env: submitit.JobEnvironment) -> str:
        return env.hostnames[0]  # the job's first node

    def attempt(self, env: submitit.JobEnvironment, run_dir: Path) -> int:
        return int(os.environ.get("SLURM_RESTART_COUNT") or 0) + 1

    def requeue(self, env: submitit.JobEnvironment) -> tuple[str, int]:
        """``scontrol requeue`` unless Slurm is already ending the job."""
        job_id = os.environ.get("SLURM_JOB_ID", env.job_id)
        # The controller's live view (accounting may lag behind a requeue in progress).
        state = slurm_state.controller_state(job_id)
        if state != "RUNNING":
            # scontrol requeue, preemption or scancel: Slurm decides what comes next.
            return f"left to Slurm (job state {state})", EXIT_REQUEUE
        out = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60
        )
        if out.returncode != 0:
            return f"failed: scontrol requeue {job_id}: {out.stderr.strip()}", EXIT_REQUEUE
        return "requeued", EXIT_REQUEUE
