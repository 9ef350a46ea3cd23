"""The ``local`` backend: every task of a job runs on this machine, with no scheduler.

"local" means one thing in the launcher: *on this machine, owned by the launcher*. The
job is submitit's local executor with the one job controller of ``launch/local_job.py``
(its pid is the job id; SIGTERM to it cancels the job, every process of it); a job lives
as long as its launcher lets it, so the launcher waits for it by default and cancels it
when it is interrupted. ``configs/clusters/local.yaml`` is this machine's profile (its
resources), which the one-node Slurm of ``scripts/slurm/start.sh`` can use as well.
(A run config's ``backend: local`` is another setting: Megatron-Core's layer
implementations, not Transformer Engine's; it does not choose where a job runs.)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import submitit
from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE

from cqk_megatron.config import ConfigError
from cqk_megatron.errors import EXIT_REQUEUE
from cqk_megatron.parallel.ports import PORT_BASE, PORT_SPAN, port_is_free
from launch import local_job
from launch.backends.base import Backend
from launch.executors import local_executor

if TYPE_CHECKING:
    from launch.resolve import RunSpec
    from launch.resources import ClusterProfile, Resources

LOOPBACK = "127.0.0.1"
_HANDED_OUT: set[int] = set()


def free_local_port(start: int | None = None) -> int:
    """A port free on 127.0.0.1 now, from ``start`` upward in the rendezvous range, not
    handed out before by this process: the launcher picks it for a local job, whose tasks
    all run here (two local jobs at once get two ports)."""
    start = PORT_BASE + os.getpid() % PORT_SPAN if start is None else start
    for offset in range(PORT_SPAN):
        port = PORT_BASE + (start - PORT_BASE + offset) % PORT_SPAN
        if port in _HANDED_OUT:
            continue
        if not port_is_free(port):
            continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {PORT_BASE}-{PORT_BASE + PORT_SPAN - 1} on {LOOPBACK}")


class LocalBackend(Backend):
    """This machine: the tasks are processes under one controller, owned by the launcher."""

    launcher_owns_jobs = True
    job_arrays = False  # no arrays here: the launcher starts array_parallelism at a time

    def check_resources(self, resources: Resources) -> None:
        if resources.nodes != 1:
            raise ConfigError(
                f"--cluster {self.name} runs on this machine only: --nodes must be 1, "
                f"not {resources.nodes}"
            )

    def executor(
        self,
        folder: Path,
        profile: ClusterProfile,
        resources: Resources,
        job_name: str,
        run_dir: Path,
    ) -> submitit.Executor:
        return local_executor(folder, profile, resources, run_dir)

    def dry_run(
        self, groups: list[tuple[list[RunSpec], Path, str]], profile: ClusterProfile, array: bool
    ) -> list[str]:
        return [f"==> {self.name} executor: no sbatch script (the tasks run on this machine)"]

    def master_port(self) -> int:
        # Every task runs here: a port checked free now beats one derived from the job id.
        return free_local_port()

    def job_state(self, job_id: str) -> str:
        """RUNNING while the job's controller (its pid is the job id) lives."""
        try:
            pid = int(job_id)
        except ValueError:
            return "UNKNOWN"
        return "RUNNING" if local_job.is_controller(pid) else "FINISHED"

    def live_state(self, job: submitit.Job[Any]) -> str:
        return job.state  # the launcher's own process handle: the surest word on it

    def exited(self, job: submitit.Job[Any]) -> bool:
        return job.done()  # a child process: Popen.poll costs nothing

    def cancel(self, job_id: str) -> str:
        os.kill(int(job_id), signal.SIGTERM)  # the controller: see launch.local_job
        return f"SIGTERM to {self.name} job {job_id}"

    def rendezvous_address(self, env: submitit.JobEnvironment) -> str:
        return LOOPBACK

    def requeue(self, env: submitit.JobEnvironment) -> tuple[str, int]:
        if local_job.is_cancelled(env.paths.folder, env.job_id):
            return "cancelled: not requeued", EXIT_REQUEUE
        # The controller is this task's parent; once it is gone (kill -9: the kernel sent
        # us SIGTERM), this task is an orphan and nobody starts it again.
        if not local_job.is_controller(os.getppid()):
            return (
                f"not requeued: the job's controller (job {env.job_id}) is gone; submit "
                "the same command again to resume"
            ), EXIT_REQUEUE
        # The controller starts the tasks again when one exits with this.
        return "requeued", LOCAL_REQUEUE_RETURN_CODE
