"""The launcher as a library: train one resolved run on this machine through the same path
as ``cqk submit --cluster local`` (``launch.jobs.submit_group`` with the ``local``
backend: submitit's local executor with the one job controller of ``launch/local_job.py``,
and ``job.TrainingJob`` in every task), then wait for it with a deadline.

    from launch.api import submit_local, wait_local

    submitted = submit_local(config, tasks=2)          # validated for 2 tasks, submitted
    outcome = wait_local(submitted, on_line=print)     # "finished", "stopped" or "failed"

``cqk_megatron.repro`` trains its runs this way. What the job does is the launcher's: a
finished run is skipped, a partial one resumes from its newest complete checkpoint, a
failed attempt is relaunched at most ``max_restarts`` times, and a stop with a checkpoint
(a signal, ``train.resilience.exit_after_steps``, the time limit) is requeued at most
``max_requeues`` times (0: the job ends, and its run's last record is ``stopped`` with
exit 75, ``EXIT_REQUEUE``). Each task's output is in ``RUN/submitit/JOBID_K_log.out`` and
``.err``; ``wait_local`` also copies rank 0's, as it comes, to ``log`` (repro:
``RUN/train.log``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from submitit.core.utils import JobPaths

from cqk_megatron.config import ConfigError, RunConfig
from cqk_megatron.errors import EXIT_REQUEUE
from launch import run_dir as runs
from launch.backends import Backend, get_backend
from launch.backends.registry import LOCAL
from launch.jobs import Progress, cancel_jobs, held_by, submit_group
from launch.local_job import CANCEL_GRACE_S
from launch.resolve import RunSpec, resolve
from launch.resources import ClusterProfile, Resources, time_minutes

POLL_S = 0.5  # how often the wait reads the job's state and rank 0's new output
# past the job's own time limit (after which its controller ends it), how long the wait
# goes on before it cancels the job itself: its ranks save a checkpoint in that grace
DEADLINE_SLACK_S = CANCEL_GRACE_S + 60
ENDINGS = ("finished", "stopped", "failed", "refused")  # a job's last record in events.jsonl


@dataclass
class LocalSubmission:
    spec: RunSpec
    job: object  # submitit's LocalJob: job_id is the controller's PID
    deadline_s: float  # seconds from submission the wait allows the job
    backend: Backend = field(default_factory=lambda: get_backend(LOCAL))
    submitted_at: float = field(default_factory=time.monotonic)

    @property
    def run_dir(self) -> Path:
        return self.spec.run_dir

    def task_logs(self, task: int = 0) -> tuple[Path, Path]:
        paths = JobPaths(self.job.paths.folder, self.job.job_id, task)
        return paths.stdout, paths.stderr


def submit_local(
    config: RunConfig,
    tasks: int = 1,
    *,
    gpus: bool = False,
    time_limit: str = "1-00:00:00",
    cpus_per_task: int | None = None,
    max_requeues: int = 0,
    max_restarts: int = 0,
    resume: str = "auto",
    env: dict[str, str] | None = None,
    argv: list[str] | None = None,
) -> LocalSubmission:
    """Submit ``config`` as one local job of ``tasks`` processes (one per GPU if ``gpus``),
    after ``launch.resolve.resolve`` validates it for that world size (``ConfigError``). A run
    folder that a live process holds is refused (``ConfigError``). ``env``: variables the
    job exports; ``argv``: the command recorded with the submission."""
    resources = Resources(
        nodes=1,
        gpus_per_node=tasks if gpus else 0,
        tasks_per_node=tasks,
        cpus_per_task=cpus_per_task,
        time=time_limit,
        max_requeues=max_requeues,
        max_restarts=max_restarts,
    )
    time_minutes(resources.time, "time_limit")  # a bad limit: ConfigError naming it
    backend = get_backend(LOCAL)
    spec = resolve(config, resources, backend.name)
    holder = held_by(spec)
    if holder is not None:
        raise ConfigError(f"run folder {spec.run_dir} is {holder}; wait for it or end it")
    profile = ClusterProfile(cluster=backend.name, env=dict(env or {}))
    progress = Progress(backend, "lines")  # submit_group registers the job; no polling here
    [job] = submit_group([spec], profile, backend, None, list(argv or []), progress, resume)
    deadline = 60 * time_minutes(resources.time) + DEADLINE_SLACK_S
    return LocalSubmission(spec, job, deadline, backend)


class _Follower:
    """Copies the lines a file gains to a callback, from where it was read last."""

    def __init__(self, path: Path, on_line: Callable[[str], None]) -> None:
        self.path, self.on_line, self.offset, self.partial = path, on_line, 0, ""

    def read(self, final: bool = False) -> None:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as handle:
                handle.seek(self.offset)
                text = handle.read()
                self.offset = handle.tell()
        except FileNotFoundError:
            return
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = ""
        for line in lines:
            self.on_line(line + "\n")


def outcome(submission: LocalSubmission) -> tuple[str, int | None]:
    """How the job's run ended, from its last ending record in ``events.jsonl``: finished,
    stopped (a checkpoint was saved; exit 75), failed or refused; ``failed`` when the job
    left none (its controller gave up, or a rank was killed)."""
    job_id = str(submission.job.job_id)
    ends = [
        e
        for e in runs.events(submission.run_dir)
        if e.get("event") in ENDINGS and str(e.get("job_id")) == job_id
    ]
    if runs.is_finished(submission.run_dir, submission.spec.config.train.train_steps):
        return "finished", 0
    if not ends:
        return "failed", None
    last = ends[-1]
    if last["event"] == "stopped":
        return "stopped", last.get("exit", EXIT_REQUEUE)
    return ("failed" if last["event"] == "finished" else last["event"]), last.get("exit")


def wait_local(
    submission: LocalSubmission,
    on_line: Callable[[str], None] | None = None,
    timeout_s: float | None = None,
) -> tuple[str, int | None]:
    """Until the job ends (``outcome``), passing rank 0's new output lines to ``on_line``.
    Past ``timeout_s`` (default: the job's time limit plus ``DEADLINE_SLACK_S``) the job is
    cancelled (its ranks save a checkpoint) and ``TimeoutError`` raised; Ctrl-C cancels it
    too, then propagates."""
    job = submission.job
    followers = [_Follower(path, on_line) for path in submission.task_logs(0)] if on_line else []
    limit = submission.deadline_s if timeout_s is None else timeout_s
    deadline = submission.submitted_at + limit
    try:
        while not job.done():
            for follower in followers:
                follower.read()
            if time.monotonic() > deadline:
                cancel_jobs(submission.backend, [job])
                raise TimeoutError(
                    f"run {submission.spec.name}: job {job.job_id} still running after "
                    f"{limit:.0f} s; cancelled (it saved a checkpoint if it could)"
                )
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        cancel_jobs(submission.backend, [job])
        raise
    finally:
        for follower in followers:
            follower.read(final=True)
    return outcome(submission)


def default_cpus_per_task(tasks: int) -> int:
    """This machine's cores shared among ``tasks`` processes (the launcher's default on a
    CPU node is one thread per rank)."""
    return max(1, (os.cpu_count() or 1) // max(tasks, 1))
