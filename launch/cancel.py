"""``python launch/submit.py cancel RUN_DIR...``: end a run's job, every process of it.

- a Slurm job: ``scancel`` (Slurm sends SIGTERM to every task, which saves a checkpoint
  and stops, then SIGKILL after its ``KillWait``);
- a local job: SIGTERM to its controller (``launch.local_job``), which forwards it to the
  tasks, does not restart them, and kills what is left after a grace period;
- the job is the last one submitted for the run while it is queued or running, else the
  submitted job that holds the run's lease (the last submission may be a twin that was
  refused because that job held the run);
- no job of the launcher's but a live holder of the run's lease on this host (a plain
  ``cqk-train`` or ``torchrun``): SIGTERM to that process, which stops the run the same way.

It waits (``--wait-s``, default 180) until the run's lease is free, so that a resubmission
right after it cannot meet the old job still writing.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from cqk_megatron import run_lease
from cqk_megatron.run_folder import LEASE
from launch import run_dir as runs
from launch import slurm_state


def _wait_free(run_dir: Path, job_id: str | None, cluster: str | None, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        job_done = job_id is None or not slurm_state.is_active(
            slurm_state.job_state(job_id, cluster)
        )
        if job_done and run_lease.live_holder(run_dir) is None:
            return True
        time.sleep(0.5)
    return False


def _active_job(run_dir: Path, holder: run_lease.Holder | None) -> tuple[str | None, str | None]:
    """(job id, cluster) of the launcher's job to end: the last submission while it is
    active, else the submitted job that holds the run's lease. After two submissions of one
    run raced, the last is the twin that was refused while the first trains on: ending
    the holder's rank 0 instead of its job would only make its controller restart it."""
    submitted = [e for e in runs.events(run_dir) if e["event"] == "submitted"]
    candidates = submitted[-1:]
    if holder is not None and holder.job_id:
        candidates += [e for e in reversed(submitted) if str(e["job_id"]) == holder.job_id]
    for event in candidates:
        job_id, cluster = str(event["job_id"]), event["cluster"]
        if slurm_state.is_active(slurm_state.job_state(job_id, cluster)):
            return job_id, cluster
    return None, None


def cancel(run_dir: Path, wait_s: float = 180.0) -> tuple[bool, str]:
    """(ended, what happened) for one run folder."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return False, f"{run_dir}: no such run folder"
    holder = run_lease.live_holder(run_dir)
    job_id, cluster = _active_job(run_dir, holder)
    if job_id is None and holder is None:
        return True, f"{run_dir}: nothing is running"
    if job_id is not None and cluster == "slurm":
        out = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            return False, f"{run_dir}: scancel {job_id} failed: {out.stderr.strip()}"
        what = f"scancel {job_id}"
    elif job_id is not None:
        os.kill(int(job_id), signal.SIGTERM)  # the controller: see launch.local_job
        what = f"SIGTERM to local job {job_id}"
    elif holder.host == socket.gethostname():
        os.kill(holder.pid, signal.SIGTERM)
        what = f"SIGTERM to pid {holder.pid} (the holder of {run_dir / LEASE})"
    else:
        return False, (
            f"{run_dir}: held by {holder.describe()}, which no job of this launcher started "
            f"and which runs on another host; stop it there"
        )
    runs.append_event(run_dir, "cancelled", job_id=job_id, how=what)
    if _wait_free(run_dir, job_id, cluster, wait_s):
        return True, f"{run_dir}: cancelled ({what}); the run is free"
    return False, f"{run_dir}: {what} sent, but the run is still held after {wait_s:.0f} s"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="submit.py cancel", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (log.root/name)")
    parser.add_argument(
        "--wait-s",
        type=float,
        default=180.0,
        help="seconds to wait for the jobs to end (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    failed = 0
    for run in args.runs:
        ended, text = cancel(Path(run), args.wait_s)
        failed += not ended
        print(text, flush=True)
    return 1 if failed else 0
