"""The launch backend protocol: what the launcher and a job's tasks ask of where they run.

A backend is chosen by name (``--cluster NAME``, or a cluster profile's ``cluster:``) from
the registry (``launch.backends.registry``); ``slurm`` and ``local`` ship. The launcher
holds one instance for a submission and hands it, pickled with ``launch.job.TrainingJob``,
to every task of the job, so that both sides of a job ask the same object:

- launcher side: the resources it accepts, the submitit executor, what a dry run shows,
  the job's state from its recorded id, how a job ends (``cancel``), and whether the
  launcher owns its jobs (waits for them by default, cancels them when it is stopped);
- job side, in every task: the rendezvous address, the attempt number, and the requeue
  of a run that stopped with a checkpoint.

Job states use Slurm's names (``RUNNING``, ``COMPLETED``, ...; ``UNKNOWN`` when nobody
knows any more): ``is_active`` reads them the same for every backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from cqk_megatron.run.folder import events

if TYPE_CHECKING:  # the protocol itself imports no executor
    import submitit

    from launch.resolve import RunSpec
    from launch.resources import ClusterProfile, Resources

# States after which a job will not run again by itself.
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "BOOT_FAIL",
    "DEADLINE",
    "SPECIAL_EXIT",
    "REVOKED",
    "FINISHED",
    "INTERRUPTED",
}
# States of a job that is queued, running or on its way back to the queue.
ACTIVE_STATES = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SUSPENDED",
    "STOPPED",
    "SIGNALING",
    "STAGE_OUT",
    "RESV_DEL_HOLD",
    "PREEMPTED",
}


def is_active(state: str) -> bool:
    """Queued, running or coming back (``CANCELLED by 0``: the first word counts)."""
    return state.split()[0] in ACTIVE_STATES


class Backend(ABC):
    """Where a job's tasks run, and how the launcher starts, follows and ends them."""

    # True: the jobs live only as long as their launcher lets them (no scheduler owns
    # them): the launcher waits for them unless told not to, and cancels them when it is
    # interrupted. False: a scheduler owns them; they stay queued when the launcher ends.
    launcher_owns_jobs: ClassVar[bool] = False
    # True: the runs of a group that share resources go out as one job array; False: one
    # job a run, at most ``resources.array_parallelism`` running at once (the launcher
    # holds the next back until one ends).
    job_arrays: ClassVar[bool] = False
    # Its jobs are sbatch scripts: ``cqk submit --emit-sbatch`` can write them for a site's
    # admin to submit by hand (``launch/sbatch_file.py``).
    sbatch_scripts: ClassVar[bool] = False

    def __init__(self, name: str) -> None:
        self.name = name  # the registry's name: what --cluster said, and jobs.jsonl records

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # -- launcher side --------------------------------------------------------------------

    def check_resources(self, resources: Resources) -> None:  # noqa: B027 - most take any
        """Raise ``ConfigError`` for resources this backend cannot give (naming the fix)."""

    def submission_notes(self) -> list[str]:
        """Lines worth saying before a submission (an unset setting, say)."""
        return []

    @abstractmethod
    def executor(
        self,
        folder: Path,
        profile: ClusterProfile,
        resources: Resources,
        job_name: str,
        run_dir: Path,
    ) -> submitit.Executor:
        """The submitit executor for one job (or one job array) in ``folder``."""

    @abstractmethod
    def dry_run(
        self, groups: list[tuple[list[RunSpec], Path, str]], profile: ClusterProfile, array: bool
    ) -> list[str]:
        """What would be submitted, for ``--dry-run``: a group is (its runs, its submitit
        folder, its job name); ``array``: a sweep's group goes out as a job array."""

    def master_port(self) -> int | None:
        """The rendezvous port, when the launcher picks it at submission; ``None``: each
        task derives it from the job id (``cqk_megatron.parallel.ports.rendezvous_port``)."""
        return None

    @abstractmethod
    def job_state(self, job_id: str) -> str:
        """The state of the job recorded as ``job_id`` (``UNKNOWN`` when nobody knows)."""

    def live_state(self, job: submitit.Job[Any]) -> str:
        """The state of a job this launcher submitted (its submitit handle)."""
        return self.job_state(str(job.job_id))

    def exited(self, job: submitit.Job[Any]) -> bool:
        """Whether ``job`` has visibly ended, where knowing costs nothing (a child process);
        ``False`` where only asking the scheduler would tell."""
        return False

    @abstractmethod
    def cancel(self, job_id: str) -> str:
        """Ask the job to end (its ranks save a checkpoint and stop); what was done, as
        one phrase. ``RuntimeError`` if it could not be asked."""

    # -- job side (in every task) ---------------------------------------------------------

    @abstractmethod
    def rendezvous_address(self, env: submitit.JobEnvironment) -> str:
        """``MASTER_ADDR``: where rank 0 listens."""

    def attempt(self, env: submitit.JobEnvironment, run_dir: Path) -> int:
        """1 for this job's first run, 2 after one requeue or relaunch, ...: by default
        one more than the ``started`` records the job has left."""
        starts = [
            e for e in events(run_dir) if e["event"] == "started" and e.get("job_id") == env.job_id
        ]
        return len(starts) + 1

    @abstractmethod
    def requeue(self, env: submitit.JobEnvironment) -> tuple[str, int]:
        """Rank 0, once the run stopped with a checkpoint: start the job again where the
        backend can. (What happened, the exit code for the tasks.)"""
