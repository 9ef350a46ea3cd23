"""``python launch/submit.py cancel RUN_DIR...``: end a run's job, every process of it.

- a Slurm job: ``scancel`` (Slurm sends SIGTERM to every task, which saves a checkpoint
  and stops, then SIGKILL after its ``KillWait``);
- a local job: SIGTERM to its controller (``launch.local_job``), which forwards it to the
  tasks, does not restart them, and kills what is left after a grace period;
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


def cancel(run_dir: Path, wait_s: float = 180.0) -> tuple[bool, str]:
    """(ended, what happened) for one run folder."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return False, f"{run_dir}: no such run folder"
    submitted = runs.last_submission(run_dir)
    job_id, cluster = None, None
    if submitted is not None:
        job_id, cluster = str(submitted["job_id"]), submitted["cluster"]
        state = slurm_state.job_state(job_id, cluster)
        if not slurm_state.is_active(state):
            job_id = None
    holder = run_lease.live_holder(run_dir)
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
    parser.add_argument("--wait-s", type=float, default=180.0, help="how long to wait")
    args = parser.parse_args(argv)
    failed = 0
    for run in args.runs:
        ended, text = cancel(Path(run), args.wait_s)
        failed += not ended
        print(text, flush=True)
    return 1 if failed else 0
