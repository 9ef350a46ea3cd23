"""``cqk status RUN_DIR...``: where a run stands.

For each run folder: the latest job and its state (from its launch backend), the
attempt it is on, each failed attempt with its cause, where it restarted and the steps
lost (launch/attempts.py), the process holding the run (its lease), why the last job
refused to start or failed, the latest step, training and validation loss, the newest
complete checkpoint, whether the run finished (or is partial, or failed: the run contract's
``run_status``), the free disk space (a full disk cuts logs
short, so it is said here), and the tail of its rank-0 log (and of the failed rank's, when
another rank failed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cqk_megatron.cli.args import plain, subcommand_program
from cqk_megatron.errors import EXIT_REFUSED
from cqk_megatron.run import lease as run_lease
from cqk_megatron.run.folder import run_status
from cqk_megatron.run.unwritable import free_bytes, human_bytes
from launch import attempts
from launch import run_dir as runs
from launch.backends import is_active
from launch.jobs import recorded_state

LOW_DISK_BYTES = 1 << 30  # below this, status says the disk is (nearly) full


def _tail(path: Path, lines: int) -> list[str]:
    if not path.is_file():
        return []
    with path.open("rb") as file:
        file.seek(0, 2)
        size = file.tell()
        file.seek(max(0, size - 64 * 1024))
        text = file.read().decode(errors="replace")
    return text.splitlines()[-lines:]


def describe(run_dir: Path, log_lines: int = 10) -> str:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return f"{run_dir}: no such run folder"
    out = [f"run        {run_dir.resolve()}"]
    history = runs.events(run_dir)
    submitted = runs.last_submission(run_dir)
    if submitted is None:
        out.append("job        none submitted by cqk submit (no jobs.jsonl)")
    else:
        job_id, cluster = str(submitted["job_id"]), submitted["cluster"]
        state = recorded_state(submitted)
        if not is_active(state) and runs.job_cancelled(run_dir, job_id):
            state = "CANCELLED"  # by cqk cancel: its ranks saved and exited
        starts = [e for e in history if e["event"] == "started" and e.get("job_id") == job_id]
        where = f" on {starts[-1].get('host')}" if starts else ""
        attempt = f", attempt {starts[-1].get('attempt')}" if starts else ", not started yet"
        out.append(f"job        {job_id} ({cluster}): {state}{attempt}{where}")
        stops = [e for e in history if e["event"] == "stopped" and e.get("job_id") == job_id]
        if stops:
            out.append(
                f"last stop  exit {stops[-1].get('exit')}, requeue: {stops[-1].get('requeue')}"
            )
        out.extend(_failed_attempts(run_dir, job_id))
    out.extend(_holder_and_problems(run_dir, history))
    status = run_status(run_dir)
    train = runs.latest_train_record(run_dir)
    valid = runs.latest_valid_record(run_dir)
    if status.finished:
        summary = status.summary
        out.append(f"finished   yes: {summary.get('steps')} steps, {summary.get('tokens')} tokens")
    elif status.state == "failed":
        out.append(f"finished   no: failed ({status.why})")
    else:
        out.append(f"finished   no ({status.state})")
    if train is not None:
        out.append(
            f"progress   step {train['step']}, loss {train['loss']:.4f}, lr {train['lr']:.3g}"
        )
    if valid is not None:
        out.append(f"validation step {valid['step']}, loss {valid['val_loss']:.4f}")
    checkpoint = runs.latest_checkpoint(run_dir)
    out.append(f"checkpoint {checkpoint or 'none yet'}")
    free = free_bytes(run_dir)
    full = " (nearly full: a job may fail to save or to log)" if free < LOW_DISK_BYTES else ""
    out.append(f"disk       {human_bytes(free)} free{full}")
    logs = [e["log"] for e in history if e["event"] == "started" and e.get("log")]
    if logs:
        for stream in ("stdout", "stderr"):
            path = Path(logs[-1][stream])
            tail = _tail(path, log_lines)
            out.append(f"log tail   {path} ({len(tail)} lines)")
            out.extend(f"  | {line}" for line in tail)
        out.extend(_failed_rank_log(history, logs[-1], log_lines))
    return "\n".join(out)


def _failed_attempts(run_dir: Path, job_id: str) -> list[str]:
    """Each failed attempt of the job: its cause, where it restarted, the work lost. An
    attempt that refused the run never trained: the ``refused`` line says why."""
    records = [r for r in attempts.failures(run_dir, job_id) if not attempts.was_refused(r)]
    if not records:
        return []
    return [
        f"failures   {len(records)}, {attempts.relaunch_summary(records)}",
        *(f"  - {attempts.attempt_line(r)}" for r in records),
    ]


def _failed_rank_log(history: list[dict], rank0_log: dict, log_lines: int) -> list[str]:
    """The error is in the log of the rank that failed, not always rank 0's: show it."""
    failed = [e for e in history if attempts.is_attempt_record(e)]
    rank = (failed[-1].get("cause") or {}).get("rank") if failed else None
    if not isinstance(rank, int) or rank == 0:
        return []
    path = Path(rank0_log["stderr"].replace("_0_log.", f"_{rank}_log."))
    tail = [line for line in _tail(path, 20 * log_lines) if not line.startswith("frame #")]
    tail = tail[-log_lines:]
    return [f"rank {rank} log {path} ({len(tail)} lines)", *(f"  | {line}" for line in tail)]


def _holder_and_problems(run_dir: Path, history: list[dict]) -> list[str]:
    out = []
    holder = run_lease.read_holder(run_dir)
    if holder is not None:
        alive = "" if holder.alive() else " (dead: the next job takes the run over)"
        out.append(f"held by    {holder.describe()}{alive}")
    # A failed attempt that the relauncher recorded (it has a cause) is listed by
    # _failed_attempts; here: refusals, cancels and failures that ended a job outright.
    problems = [
        e
        for e in history
        if e["event"] in ("refused", "cancelled")
        or (e["event"] == "failed" and not attempts.is_attempt_record(e))
    ]
    if problems:
        last = problems[-1]
        why = last.get("reason") or last.get("how") or ""
        first_line = why.splitlines()[0] if why else ""
        out.append(f"{last['event']:<10} job {last.get('job_id')}: {first_line}")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog=subcommand_program("launch/submit.py", "status"),
        description=plain(__doc__.split("\n\n")[0]),
    )
    runs.add_runs_argument(parser)
    parser.add_argument(
        "--lines", type=int, default=10, help="log lines to show per stream (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    try:
        run_dirs = [runs.find_run(run) for run in args.runs]
    except runs.AmbiguousRun as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_REFUSED
    missing = 0
    for i, (run, run_dir) in enumerate(zip(args.runs, run_dirs, strict=True)):
        if not run_dir.is_dir():  # a mistyped name or path: the user's to fix, as exit 2 says
            missing += 1
            print(f"error: {runs.not_found(run)}", file=sys.stderr)
            continue
        if i > missing:
            print()
        print(describe(run_dir, args.lines))
    return EXIT_REFUSED if missing else 0
