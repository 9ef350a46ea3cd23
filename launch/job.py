"""The submitted callable: rendezvous from submitit's job environment, then train.

Every task of a job runs ``TrainingJob()`` (submitit unpickles it from the job folder).
It reads its rank from ``submitit.JobEnvironment`` and exports the torchrun variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` = the launch backend's address:
the first node on Slurm, 127.0.0.1 locally, ``MASTER_PORT`` = 20000 + job id mod 12000, as
``cqk_megatron.parallel.process_groups`` derives it under plain ``srun``; a local job's
port is chosen free by the launcher), then calls the training loop in-process. The backend
(``launch.backends``) travels with the pickled job, so that its tasks ask the launcher's.

Preemption and time limits go through the training loop's own signal path: Slurm sends
USR1 ``signal_delay_s`` before the time limit (``#SBATCH --signal=USR1@N``) and SIGTERM on
preemption or ``scontrol requeue``; every rank then saves one checkpoint collectively and
``train`` returns ``EXIT_REQUEUE``. Rank 0 requeues the job if Slurm is not already ending
it (a time limit, a wall-clock budget): ``scontrol requeue``, at most ``max_requeues``
times. The tasks then exit with ``EXIT_REQUEUE`` and no result, as submitit expects of a
job that will run again; the requeued job resumes from the newest complete checkpoint.
Under submitit's local executor rank 0 exits with its requeue code instead (144), and the
local controller starts the tasks again, unless the job was cancelled or the controller is
gone (killed: its tasks got SIGTERM from the kernel), which the record then says. A run
that has finished is never trained again.

A USR1 that arrives before the training loop has installed its handler (during
start-up) reaches submitit's handler instead, which calls ``checkpoint()`` below and
requeues: nothing was trained yet, so resubmitting the same callable loses nothing.
submitit ignores SIGTERM ("Bypassing signal SIGTERM"), so one that comes during start-up
(a cancel, ``scontrol requeue``) is kept and sent again once the loop's handler is in
place (``keep_early_sigterm``): the run stops at its first step, with a checkpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import submitit

from cqk_megatron.config import RunConfig, from_dict
from cqk_megatron.errors import EXIT_INTERRUPTED, EXIT_REFUSED, EXIT_REQUEUE
from cqk_megatron.parallel.ports import rendezvous_port
from launch import run_dir as runs
from launch.backends import Backend, get_backend


def rendezvous(
    env: submitit.JobEnvironment, backend: Backend, master_port: int | None = None
) -> dict[str, str]:
    """torchrun's variables for this task, from submitit's view of the job; the address
    is the backend's, the port ``master_port`` when the launcher chose one (local jobs),
    else derived from the job id."""
    # An array task has its own numeric SLURM_JOB_ID: distinct ports for distinct tasks.
    job_id = os.environ.get("SLURM_JOB_ID") or env.job_id
    variables = {
        "RANK": str(env.global_rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.num_tasks),
        "LOCAL_WORLD_SIZE": str(env.num_tasks // max(env.num_nodes, 1)),
        "NODE_RANK": str(env.node),
        "MASTER_ADDR": backend.rendezvous_address(env),
        "MASTER_PORT": str(master_port or rendezvous_port(job_id)),
    }
    os.environ.update(variables)
    return variables


def keep_early_sigterm(check_s: float = 0.05) -> None:
    """From now until the training loop installs its own SIGTERM handler, a SIGTERM is
    kept and then sent again to this process, so that the loop stops on it. Without
    this, submitit's handler drops it: a local job cancelled during start-up trained
    on until its controller killed it ``CANCEL_GRACE_S`` later."""
    waiting: list[threading.Thread] = []

    def redeliver() -> None:  # bounded by the process: a daemon thread
        while signal.getsignal(signal.SIGTERM) is keep:
            time.sleep(check_s)  # start-up: until the loop's handler replaces ours
        os.kill(os.getpid(), signal.SIGTERM)

    def keep(signum, frame) -> None:
        if not waiting:
            print("SIGTERM during start-up: stopping once training starts", flush=True)
            waiting.append(threading.Thread(target=redeliver, daemon=True))
            waiting[0].start()

    signal.signal(signal.SIGTERM, keep)


class TrainingJob(submitit.helpers.Checkpointable):
    """Train one run (a resolved config) in every task of a job, resuming if it can."""

    def __init__(
        self,
        config: dict,
        max_requeues: int = 10,
        master_port: int | None = None,
        max_restarts: int = 3,
        max_identical_failures: int = 2,
        resume: str = "auto",
        backend: Backend | None = None,
    ):
        self.config = config
        # The launcher's backend, pickled with the job: its tasks ask it for the
        # rendezvous address, the attempt number and the requeue. None: the backend named
        # by submitit's job environment (``slurm`` or ``local``).
        self.backend = backend
        self.max_requeues = max_requeues
        self.master_port = master_port  # local jobs: chosen free by the launcher
        # Read by the Slurm batch script's teardown (launch/attempts.py) from the pickle.
        self.max_restarts = max_restarts
        self.max_identical_failures = max_identical_failures
        self.resume = resume  # --resume of the launcher: until a run of this job starts

    def run_config(self) -> RunConfig:
        return from_dict(RunConfig, self.config, source="submitted config")

    def job_backend(self, env: submitit.JobEnvironment) -> Backend:
        return self.backend or get_backend(env.cluster)

    def __call__(self) -> int:
        env = submitit.JobEnvironment()
        keep_early_sigterm()
        backend = self.job_backend(env)
        variables = rendezvous(env, backend, self.master_port)
        config = self.run_config()
        run_dir = Path(config.log.root) / config.name
        rank0 = env.global_rank == 0
        if runs.is_finished(run_dir, config.train.train_steps):
            if rank0:
                runs.append_event(run_dir, "skipped", job_id=env.job_id, reason="finished")
            return 0
        # rank 0 records and requeues
        attempt = backend.attempt(env, run_dir) if rank0 else 0
        if rank0:
            self._record_start(env, backend, run_dir, variables, attempt)

        code = self._train(env, config, run_dir, rank0)
        # Training is over for this attempt: a late warning signal has nothing to save.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        if code not in (0, EXIT_REQUEUE):
            # EXIT_WATCHDOG (rendezvous failed): the launcher records and relaunches.
            sys.exit(code)
        if code != EXIT_REQUEUE:
            if rank0:
                runs.append_event(run_dir, "finished", job_id=env.job_id, exit=code)
            return code
        exit_code = EXIT_REQUEUE
        if rank0:
            outcome, exit_code = self._requeue(env, attempt)
            runs.append_event(run_dir, "stopped", job_id=env.job_id, exit=code, requeue=outcome)
            print(f"checkpoint saved; requeue: {outcome}", flush=True)
        # No result pickle: to submitit the job is not over while it is requeued.
        sys.exit(exit_code)

    def _resume_now(self, env, run_dir: Path) -> str:
        """``self.resume`` until a run of this job has started with it; then ``auto``:
        a requeued attempt must not start over (``none``) or go back to ``weights:PATH``.
        Every rank reads the same record, written before its first checkpoint."""
        applied = [
            e
            for e in runs.events(run_dir)
            if e["event"] == "resume-applied" and e.get("job_id") == env.job_id
        ]
        return "auto" if applied else self.resume

    def _train(self, env, config: RunConfig, run_dir: Path, rank0: bool) -> int:
        """The training loop's exit code; a run it refuses to start (its folder held by
        another job, checkpoints that do not verify, bad data), or a save refused for a
        full disk, ends this job with exit 2 and a ``refused`` record, without a requeue."""
        from cqk_megatron.errors import is_refusal
        from cqk_megatron.run.checkpoint_files import CheckpointSaveError
        from cqk_megatron.training.collector import heavy_imports

        with heavy_imports():  # Megatron, DeepSpeed
            from cqk_megatron.training.loop import train

        resume = self._resume_now(env, run_dir)

        def started() -> None:  # rank 0, once the run really starts
            if resume != "auto":
                runs.append_event(run_dir, "resume-applied", job_id=env.job_id, resume=resume)

        try:
            return train(config, resume=resume, on_start=started)
        except KeyboardInterrupt:  # a second cancel (the launcher's second Ctrl-C)
            _stopped_at_once(run_dir, rank0)
        except Exception as error:
            if not is_refusal(error):  # a full disk at a save is one: not relaunched
                if rank0 and isinstance(error, CheckpointSaveError):
                    runs.append_event(run_dir, "failed", job_id=env.job_id, reason=str(error))
                raise
            if rank0:
                print(f"error: {error}", file=sys.stderr, flush=True)
                runs.append_event(run_dir, "refused", job_id=env.job_id, reason=str(error))
            sys.exit(EXIT_REFUSED)

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        """submitit's requeue hook: the run's state is its checkpoints on disk, so the
        same callable resumes it."""
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    def _record_start(
        self, env, backend: Backend, run_dir: Path, variables: dict[str, str], attempt: int
    ) -> None:
        paths = env.paths
        _record_unended_attempt(run_dir, env.job_id, attempt)
        runs.append_event(
            run_dir,
            "started",
            job_id=env.job_id,
            cluster=backend.name,
            attempt=attempt,
            host=socket.gethostname(),
            hosts=list(env.hostnames),
            rendezvous=variables,
            log={"stdout": str(paths.stdout), "stderr": str(paths.stderr)},
            slurm={k: v for k, v in sorted(os.environ.items()) if k.startswith("SLURM_")},
        )

    def _requeue(self, env, attempt: int) -> tuple[str, int]:
        """Requeue this job, within ``max_requeues``, where its backend can: (what
        happened, exit code)."""
        if attempt - 1 >= self.max_requeues:
            return f"refused: requeued {attempt - 1} times already (max_requeues)", EXIT_REQUEUE
        return self.job_backend(env).requeue(env)


def _stopped_at_once(run_dir: Path, rank0: bool) -> None:
    """One line for a job stopped at once, without its save, and its exit code (130)."""
    from cqk_megatron.run.checkpoint_files import latest_name
    from cqk_megatron.run.folder import CHECKPOINTS

    if rank0:
        checkpoints = run_dir / CHECKPOINTS
        newest = latest_name(checkpoints) if checkpoints.is_dir() else None
        kept = (
            f"the newest complete checkpoint is still {checkpoints / newest}"
            if newest
            else ("no checkpoint of this run was written")
        )
        print(f"interrupted: stopped at once, without saving; {kept}", file=sys.stderr, flush=True)
    sys.exit(EXIT_INTERRUPTED)


def _record_unended_attempt(run_dir: Path, job_id: str, attempt: int) -> None:
    """An earlier attempt of this job that left no ending record lost its node or its
    allocation (Slurm requeued the job itself, with ``--requeue``, and no teardown ran):
    record it now, so that ``status`` counts it."""
    from launch import attempts

    history = [e for e in runs.events(run_dir) if str(e.get("job_id")) == str(job_id)]
    starts = [e for e in history if e["event"] == "started"]
    if not starts or attempt <= starts[-1].get("attempt", 0):
        return
    after = [e for e in history if e["time"] >= starts[-1]["time"]]
    if any(e["event"] in ("failed", "stopped", "finished") for e in after):
        return
    attempts.record_lost_attempt(run_dir, job_id, starts[-1].get("attempt"), starts[-1]["time"])
