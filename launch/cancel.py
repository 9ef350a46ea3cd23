"""``cqk cancel RUN_DIR...``: end a run's job, every process of it.

- a job of the launcher's: its launch backend's cancel (``launch/backends/``): on Slurm
  ``scancel`` (Slurm sends SIGTERM to every task, which saves a checkpoint and stops, then
  SIGKILL after its ``KillWait``); locally SIGTERM to the job's controller
  (``launch.local_job``), which forwards it to the tasks, does not restart them, and kills
  what is left after a grace period;
- the job is the last one submitted for the run while it is queued or running, else the
  submitted job that holds the run's lease (the last submission may be a twin that was
  refused because that job held the run);
- no job of the launcher's but a live holder of the run's lease on this host (a plain
  ``cqk train`` or ``torchrun``): SIGTERM to that process, which stops the run the same way.

It waits (``--wait-s``, default 180) until the run's lease is free, so that a resubmission
right after it cannot meet the old job still writing.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from pathlib import Path

from cqk_megatron.cli.args import plain, subcommand_program
from cqk_megatron.errors import EXIT_REFUSED
from cqk_megatron.run import lease as run_lease
from cqk_megatron.run.folder import LEASE
from launch import run_dir as runs
from launch.backends import Backend, get_backend, is_active
from launch.jobs import recorded_state


def _wait_free(run_dir: Path, job: tuple[Backend, str] | None, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        job_done = job is None or not is_active(job[0].job_state(job[1]))
        if job_done and run_lease.live_holder(run_dir) is None:
            return True
        time.sleep(0.5)
    return False


def _active_job(run_dir: Path, holder: run_lease.Holder | None) -> tuple[Backend, str] | None:
    """(backend, job id) of the launcher's job to end: the last submission while it is
    active, else the submitted job that holds the run's lease. After two submissions of one
    run raced, the last is the twin that was refused while the first trains on: ending
    the holder's rank 0 instead of its job would only make its controller restart it."""
    submitted = [e for e in runs.events(run_dir) if e["event"] == "submitted"]
    candidates = submitted[-1:]
    if holder is not None and holder.job_id:
        candidates += [e for e in reversed(submitted) if str(e["job_id"]) == holder.job_id]
    for event in candidates:
        if is_active(recorded_state(event)):
            return get_backend(event["cluster"]), str(event["job_id"])
    return None


def cancel(run_dir: Path, wait_s: float = 180.0) -> tuple[bool, str]:
    """(ended, what happened) for one run folder."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return False, f"{run_dir}: no such run folder"
    holder = run_lease.live_holder(run_dir)
    job = _active_job(run_dir, holder)
    if job is None and holder is None:
        return True, f"{run_dir}: nothing is running"
    if job is not None:
        backend, job_id = job
        try:
            what = backend.cancel(job_id)
        except RuntimeError as error:
            return False, f"{run_dir}: {error}"
    elif holder.host == socket.gethostname():
        job_id = None
        os.kill(holder.pid, signal.SIGTERM)
        what = f"SIGTERM to pid {holder.pid} (the holder of {run_dir / LEASE})"
    else:
        return False, (
            f"{run_dir}: held by {holder.describe()}, which no job of this launcher started "
            f"and which runs on another host; stop it there"
        )
    runs.append_event(run_dir, "cancelled", job_id=job_id, how=what)
    if _wait_free(run_dir, job, wait_s):
        return True, f"{run_dir}: cancelled ({what}); the run is free"
    return False, f"{run_dir}: {what} sent, but the run is still held after {wait_s:.0f} s"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog=subcommand_program("launch/submit.py", "cancel"),
        description=plain(__doc__.split("\n\n")[0]),
    )
    runs.add_runs_argument(parser)
    parser.add_argument(
        "--wait-s",
        type=float,
        default=180.0,
        help="seconds to wait for the jobs to end (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        run_dirs = [runs.find_run(run) for run in args.runs]
    except runs.AmbiguousRun as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_REFUSED
    failed = missing = 0
    for run, run_dir in zip(args.runs, run_dirs, strict=True):
        if not run_dir.is_dir():  # a mistyped name or path: the user's to fix, as exit 2 says
            missing += 1
            print(f"error: {runs.not_found(run)}", file=sys.stderr, flush=True)
            continue
        ended, text = cancel(run_dir, args.wait_s)
        failed += not ended
        print(text, flush=True)
    return EXIT_REFUSED if missing else 1 if failed else 0
