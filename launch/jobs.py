"""Submitting runs and following their jobs, for any launch backend: the library that
``launch/submit.py`` (the command line) and ``launch.api`` (Python) share.

A group of runs that share resources goes out as one job array where the backend has
them (Slurm), else as one job a run, ``array_parallelism`` at a time (local). Each job is
recorded in its run's ``jobs.jsonl`` (``submitted``: job id, the backend's name,
resources, the command) and followed by ``Progress`` until it ends.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import yaml

from cqk_megatron.cli.args import program
from cqk_megatron.config import ConfigError, to_dict
from cqk_megatron.run import lease as run_lease
from cqk_megatron.run.folder import SUBMITIT
from launch import run_dir as runs
from launch.backends import Backend, get_backend, is_active
from launch.executors import REPO
from launch.job import TrainingJob
from launch.resolve import RunSpec
from launch.resources import ClusterProfile, sbatch_parameters

# -- where a group's jobs go --------------------------------------------------------------


def submitit_folder(group: list[RunSpec], sweep) -> Path:
    if sweep is None:
        return group[0].run_dir / SUBMITIT
    return Path(group[0].config.log.root) / SUBMITIT


def job_name(group: list[RunSpec], sweep) -> str:
    """A single run's name, or the sweep's ``name`` (which prefixes its runs' names)."""
    if sweep is None:
        return group[0].name
    return (yaml.safe_load(Path(sweep).read_text()) or {}).get("name") or Path(sweep).stem


def group_by_resources(specs: list[RunSpec], profile, sweep) -> list[list[RunSpec]]:
    """Runs with identical sbatch settings share one job array."""
    groups: dict[str, list[RunSpec]] = {}
    for spec in specs:
        key = repr(sorted(sbatch_parameters(profile, spec.resources, REPO, "").items()))
        key += str(spec.config.log.root)
        groups.setdefault(key, []).append(spec)
    return list(groups.values())


# -- whether a run may be submitted now ---------------------------------------------------


def recorded_state(submission: dict) -> str:
    """The state of the job a ``submitted`` record names, asked of the backend it names
    (``UNKNOWN`` if that backend is not registered in this process)."""
    try:
        backend = get_backend(submission["cluster"])
    except ConfigError:
        return "UNKNOWN"
    return backend.job_state(str(submission["job_id"]))


def held_by(spec: RunSpec) -> str | None:
    """Why not now, if a live process holds the run's lease (a job the launcher does not
    know of, a plain cqk train, or a cancelled job's ranks still saving)."""
    holder = run_lease.live_holder(spec.run_dir)
    return None if holder is None else f"in use by {holder.describe()}"


def triage(spec: RunSpec) -> str | None:
    """Why ``spec`` must not be submitted now (finished, or a job of it is active)."""
    if runs.is_finished(spec.run_dir, spec.config.train.train_steps):
        return "finished"
    last = runs.last_submission(spec.run_dir)
    if last is not None:
        state = recorded_state(last)
        if is_active(state):
            return f"job {last['job_id']} is {state}"
    return held_by(spec)


# -- submission ---------------------------------------------------------------------------


def record_submission(spec: RunSpec, job, backend: Backend, array: bool, argv: list[str]) -> None:
    runs.append_event(
        spec.run_dir,
        "submitted",
        job_id=job.job_id,
        cluster=backend.name,
        array=array,
        submitit_folder=str(job.paths.folder),
        resources=vars(spec.resources),
        command=[*program("launch/submit.py").split(), *argv],  # as typed: cqk submit or the script
    )
    runs.remember_run(spec.name, spec.run_dir)  # for status NAME
    print(
        f"submitted {spec.name}: job {job.job_id} ({backend.name}) -> {spec.folder_line()}",
        flush=True,
    )


def _training_jobs(group: list[RunSpec], backend: Backend, resume: str) -> list[TrainingJob]:
    resources = group[0].resources
    return [
        TrainingJob(
            to_dict(spec.config),
            resources.max_requeues,
            master_port=backend.master_port(),
            max_restarts=resources.max_restarts,
            max_identical_failures=resources.max_identical_failures,
            resume=resume,
            backend=backend,
        )
        for spec in group
    ]


def submit_group(
    group: list[RunSpec],
    profile: ClusterProfile,
    backend: Backend,
    sweep,
    argv: list[str],
    progress: Progress,
    resume: str = "auto",
    guard: Callable[[], AbstractContextManager] = nullcontext,
) -> list:
    """Submit runs that share resources: one job, or one job array for several where the
    backend has arrays. Each submitted job is recorded and added to ``progress``; each
    submission happens inside ``guard()`` (the launcher defers its stop signals there, so
    that a job it started is known to its cancel)."""
    # The run's config.yaml is the job's to write, after its first step
    # (cqk_megatron.run.history): a queued run has no settings that ran yet.
    callables = _training_jobs(group, backend, resume)
    if not backend.job_arrays:
        return _submit_one_by_one(group, callables, profile, backend, argv, progress, guard)
    folder = submitit_folder(group, sweep)
    executor = backend.executor(
        folder, profile, group[0].resources, job_name(group, sweep), group[0].run_dir
    )
    with guard():
        if len(group) == 1:
            jobs = [executor.submit(callables[0])]
        else:
            with executor.batch():
                jobs = [executor.submit(c) for c in callables]
        for spec, job in zip(group, jobs, strict=True):
            record_submission(spec, job, backend, len(group) > 1, argv)
            progress.add(spec, job)
    return jobs


def _submit_one_by_one(group, callables, profile, backend, argv, progress, guard) -> list:
    """One job a run, at most ``array_parallelism`` at once; the group's progress is
    shown while a run waits for its turn."""
    jobs = []
    for spec, job_callable in zip(group, callables, strict=True):
        while sum(not job.done() for job in jobs) >= spec.resources.array_parallelism:
            progress.poll()
            progress.pause()
        folder = spec.run_dir / SUBMITIT
        executor = backend.executor(folder, profile, spec.resources, spec.name, spec.run_dir)
        with guard():
            jobs.append(executor.submit(job_callable))
            record_submission(spec, jobs[-1], backend, False, argv)
            progress.add(spec, jobs[-1])
    return jobs


def cancel_jobs(backend: Backend, jobs: list, wait_s: float = 180.0) -> list:
    """End the jobs still running (each saves a checkpoint; the same command resumes
    them) and wait, at most ``wait_s`` a job, for them to end. Returns the jobs still
    running after that (a local job's controller kills what is left ``CANCEL_GRACE_S``
    after the signal)."""
    for job in jobs:
        if not job.done():
            backend.cancel(str(job.job_id))
    for job in jobs:
        deadline = time.monotonic() + wait_s
        while not job.done() and time.monotonic() < deadline:
            time.sleep(0.5)
    return [job for job in jobs if not job.done()]


# -- following the jobs -------------------------------------------------------------------

# Seconds between two looks at the submitted jobs while the launcher waits. On Slurm each
# look runs scontrol (or sacct) once per pending job: 5 s keeps that load on a busy
# controller small and is soon enough for jobs that run minutes to days. Local jobs are
# this process's children: the wait also ends as soon as one of them exits (a free
# Popen.poll), so a sweep's next run starts at once. CQK_PROGRESS_POLL_S overrides it
# (the tests' Slurm jobs, which last seconds).
POLL_S = float(os.environ.get("CQK_PROGRESS_POLL_S", "5"))
LOCAL_CHECK_S = 0.1  # how often an exit the backend sees for free is looked for meanwhile


class Progress:
    """Where the submitted jobs stand, read from each run's metrics (the jobs write to
    their own log files): a bar per run on a terminal (``mode="bar"``), else a line per
    run every 30 s (``"lines"``), and a line when a job ends, with the sweep's count."""

    def __init__(
        self, backend: Backend, mode: str = "auto", total: int = 0, poll_s: float | None = None
    ) -> None:
        self.backend, self.total = backend, total  # total: runs to submit
        self.poll_s = POLL_S if poll_s is None else poll_s
        self.mode = ("bar" if sys.stdout.isatty() else "lines") if mode == "auto" else mode
        self.pending: dict[str, tuple[RunSpec, object]] = {}
        self.bars: dict = {}
        self.ended = 0
        self._last_print = 0.0

    def add(self, spec: RunSpec, job) -> None:
        self.pending[spec.name] = (spec, job)

    def jobs(self) -> list:
        """The jobs that have not ended yet."""
        return [job for _, job in self.pending.values()]

    def _open_bars(self) -> None:
        # Opened at the first poll, not at submission: --no-wait draws none.
        from tqdm import tqdm

        for name, (spec, _) in self.pending.items():
            if name not in self.bars:
                self.bars[name] = tqdm(total=spec.config.train.train_steps, desc=name, unit="step")

    def poll(self) -> None:
        """One look at every pending job: report those that ended, show the others."""
        if self.mode == "bar":
            self._open_bars()
        for name, (spec, job) in list(self.pending.items()):
            state = self.backend.live_state(job)
            if not is_active(state):
                self._ended(name, spec, job, state)
        for spec, _ in self.pending.values():
            self._update_bar(spec)
        if self.mode != "bar" and self.pending and time.monotonic() - self._last_print > 30:
            self._last_print = time.monotonic()
            self._print_lines()

    def _ended(self, name: str, spec: RunSpec, job, state: str) -> None:
        self._update_bar(spec)
        if name in self.bars:
            self.bars.pop(name).close()
        self.ended += 1
        count = f" [{self.ended}/{self.total} ended]" if self.total > 1 else ""
        done = runs.is_finished(spec.run_dir, spec.config.train.train_steps)
        outcome = "the run finished" if done else "the run did not finish"
        if runs.job_cancelled(spec.run_dir, job.job_id):  # its ranks saved and exited
            state, outcome = "CANCELLED", "run the same command again to resume"
        print(f"{name}: job {job.job_id} ended ({state}): {outcome}{count}", flush=True)
        del self.pending[name]

    def _print_lines(self) -> None:
        for name, (spec, _) in self.pending.items():
            record = runs.latest_train_record(spec.run_dir)
            steps = spec.config.train.train_steps
            text = (
                f"step {record['step']}/{steps}, loss {record['loss']:.4f}"
                if record
                else "starting"
            )
            print(f"{name}: {text}", flush=True)

    def wait(self) -> None:
        """Until every job has ended (each poll reads every pending run's metrics file)."""
        while self.pending:
            self.poll()
            if self.pending:
                self.pause()

    def pause(self) -> None:
        """Until the next look: ``poll_s``, or less once the backend sees a job exit."""
        deadline = time.monotonic() + self.poll_s
        while (left := deadline - time.monotonic()) > 0:
            if any(self.backend.exited(job) for job in self.jobs()):
                return
            time.sleep(min(LOCAL_CHECK_S, left))

    def _update_bar(self, spec: RunSpec) -> None:
        bar = self.bars.get(spec.name)
        record = runs.latest_train_record(spec.run_dir) if bar is not None else None
        if record is None:
            return
        bar.n = record["step"]
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}")
