"""Bounded relaunch: what ended a failed attempt, whether to run it again, and the record.

One attempt is one start of every task of a job. When one task fails, its launcher ends
the others at once (``srun --kill-on-bad-exit=1`` on Slurm; the local controller in
``launch/local_job.py``); then this module, run by that launcher, works out the
cause and appends a ``failed`` event to ``jobs.jsonl``::

    {"event": "failed", "job_id", "attempt", "exits": {rank: code, negative = signal},
     "cause": {"rank", "host", "exit" | "signal", "step", "phase", "reason"},
     "step_reached", "checkpoint_step", "work_lost_steps", "decision", "why"}

The cause comes from, in order: a rank's own crash record or a watchdog verdict in
``RUN/faults.jsonl`` (which names a stopped or silent rank that never exited), else the
first task that exited badly (an exit code, or the signal that killed it), unless that
task is one that gave a verdict: it was ending because of it. Of two verdicts, one by a
rank that still reached the job's store wins over one that lost the store. The job is
started again (it resumes from the newest complete checkpoint: a half-written one is never
taken) unless ``max_restarts`` failed attempts were relaunched already, or the last
``max_identical_failures`` attempts failed the same way (same rank, same exit, same step):
a deterministic bug stops the run early instead of burning the restart budget.

Also the Slurm batch script's last step: ``python -m launch.attempts after-srun FOLDER
EXIT`` (see ``teardown_lines``) reads srun's own lines (``srun: error: node2: task 1:
Killed``) for the exits, records, and requeues the job (``scontrol requeue``) to relaunch.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cqk_megatron.errors import EXIT_REFUSED, EXIT_REQUEUE, EXIT_WATCHDOG
from cqk_megatron.run.folder import FAULTS, METRICS, TRAIN, append_event, events, read_jsonl
from launch import run_dir as runs

LOCAL_REQUEUE = 144  # submitit's local requeue code (rank 0 asks for a restart)
MARKER = "cqk-attempt: begins"  # printed by the batch script before srun (setup_lines)


@dataclass(frozen=True)
class Policy:
    max_restarts: int = 3
    max_identical_failures: int = 2


def is_bad_exit(code: int | None) -> bool:
    """A task that failed: not finished (0), not stopped to requeue (75, 144)."""
    return code is not None and code not in (0, EXIT_REQUEUE, LOCAL_REQUEUE)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by signal {-code} ({name})"
    if code == EXIT_WATCHDOG:
        return f"exited {code} (the watchdog: a peer was lost)"
    if code == EXIT_REFUSED:
        return f"refused the run (exit {code})"
    return f"exited {code}"


def _checkpoint_step(run_dir: Path) -> int:
    name = runs.latest_checkpoint(run_dir)  # only ever names a completed checkpoint
    match = re.fullmatch(r"iter_(\d+)", name or "")
    return int(match.group(1)) if match else 0


def _step_reached(run_dir: Path, since: float) -> int | None:
    steps = [
        r["step"]
        for r in read_jsonl(run_dir / METRICS)
        if r.get("kind") == TRAIN and r.get("time", 0) >= since
    ]
    return max(steps) if steps else None


def _faults_since(run_dir: Path, since: float) -> list[dict]:
    return [r for r in read_jsonl(run_dir / FAULTS) if r.get("time", 0) >= since]


def _refused_in_training(run_dir: Path, since: float) -> bool:
    """This attempt's refusal came after steps had run (``Watchdog.on_refusal`` records it
    then, and only then)."""
    return any(r.get("event") == "refused" for r in _faults_since(run_dir, since))


def find_cause(
    run_dir: Path,
    exits: dict[int, int],
    first_bad: int | None,
    since: float,
    hosts: dict[int, str] | None = None,
) -> dict:
    """Which rank ended the attempt, how, where and when (see the module's docstring)."""
    hosts = hosts or {}
    records = _faults_since(run_dir, since)
    lost = [r for r in records if r.get("event") == "lost" and r.get("ranks")]
    # In a partition both sides give verdicts, each naming the other. The store is the
    # arbiter: a rank that still reaches it and hears a peer's silence ("silent", "stuck",
    # ...) outranks one that lost the store itself ("store"), which cannot tell the
    # store's host dying from its own node being cut off.
    lost.sort(key=lambda r: r.get("kind") == "store")  # stable: by time within each
    # A rank that gave a verdict is ending because of it: whatever it does after (exit 76,
    # or killed by Slurm ending the step of a DOWN node while it closes) is not the cause.
    verdict_at = {r.get("by_rank"): r.get("time", 0) for r in reversed(lost)}
    crashed = [
        r
        for r in records
        if r.get("event") == "crashed" and r.get("time", 0) < verdict_at.get(r.get("rank"), 1e99)
    ]
    rendezvous = [r for r in records if r.get("event") == "rendezvous"]
    cause: dict = {}
    if crashed:
        first = crashed[0]
        cause = {
            "rank": first["rank"],
            "host": first.get("host"),
            "step": first.get("step"),
            "phase": first.get("phase"),
            "reason": f"crashed: {first.get('error')}",
        }
        if first["rank"] in exits:
            cause["exit"] = exits[first["rank"]]
    elif (
        first_bad is not None
        and exits.get(first_bad) != EXIT_WATCHDOG
        and first_bad not in verdict_at
    ):
        code = exits[first_bad]
        cause = {"rank": first_bad, "host": hosts.get(first_bad), "reason": describe_exit(code)}
        cause["signal" if code < 0 else "exit"] = abs(code)
    elif lost:
        first = lost[0]
        rank = first["ranks"][0]
        cause = {
            "rank": rank,
            "host": first.get("host"),
            "pid": first.get("pid"),
            "step": first.get("step"),
            "phase": first.get("phase"),
            "reason": first.get("reason"),
            "detected_by": first.get("by_rank"),
            "verdict_time": first.get("time"),
        }
        if rank in exits and is_bad_exit(exits[rank]):
            cause["ended_by_launcher"] = exits[rank]
    elif rendezvous:
        cause = {"rank": None, "reason": rendezvous[0].get("line"), "phase": "rendezvous"}
    elif first_bad is not None:
        cause = {
            "rank": first_bad,
            "host": hosts.get(first_bad),
            "reason": describe_exit(exits[first_bad]),
            "exit": exits[first_bad],
        }
    else:
        cause = {"rank": None, "reason": "the attempt ended without an exit code or record"}
    if cause.get("host") is None and cause.get("rank") in hosts:
        cause["host"] = hosts[cause["rank"]]
    return cause


def signature(record: dict) -> tuple:
    """Two failures are the same when the same rank failed the same way at the same step."""
    cause = record.get("cause", {})
    how = cause.get("signal", cause.get("exit"))
    reason = (cause.get("reason") or "").split(" (")[0] if how is None else ""
    return (cause.get("rank"), how, reason, record.get("step_reached"))


def is_attempt_record(event: dict) -> bool:
    """A failed attempt recorded here (it has a cause); a job's rank 0 also writes a
    ``failed`` event, with a ``reason`` only, when it cannot save a checkpoint."""
    return event.get("event") == "failed" and "cause" in event


def failures(run_dir: Path, job_id: str) -> list[dict]:
    return [
        e for e in events(run_dir) if is_attempt_record(e) and str(e.get("job_id")) == str(job_id)
    ]


def was_refused(record: dict) -> bool:
    """The attempt's job refused to start the run (exit ``EXIT_REFUSED``: its folder held by
    another job, checkpoints that do not verify, bad data): it never trained."""
    return (record.get("cause") or {}).get("exit") == EXIT_REFUSED


def decide(previous: list[dict], record: dict, policy: Policy) -> tuple[str, str]:
    """("relaunch" | "stop", why) for a failed attempt after the ``previous`` ones."""
    relaunched = sum(1 for p in previous if p.get("decision") == "relaunch")
    if was_refused(record):
        return "stop", (
            f"{summary_line(record)}: the run was refused (exit {EXIT_REFUSED}: bad input "
            "before training, or a full disk at a save; its log says why), which a relaunch "
            "cannot change"
        )
    same = [record]
    for p in reversed(previous):
        if signature(p) != signature(record):
            break
        same.append(p)
    if len(same) >= policy.max_identical_failures:
        return "stop", (
            f"the last {len(same)} attempts failed the same way ({summary_line(record)}): "
            "a deterministic failure, not relaunched again (max_identical_failures="
            f"{policy.max_identical_failures})"
        )
    if relaunched >= policy.max_restarts:
        return "stop", f"relaunched {relaunched} times already (max_restarts={policy.max_restarts})"
    return "relaunch", f"relaunch {relaunched + 1} of at most {policy.max_restarts}"


def record_failure(
    run_dir: Path,
    job_id: str,
    attempt: int,
    exits: dict[int, int],
    first_bad: int | None,
    since: float,
    policy: Policy,
    hosts: dict[int, str] | None = None,
    ended_by_launcher: list[int] | None = None,
    detected_at: float | None = None,
) -> dict:
    """Work out the cause, decide, append the ``failed`` event; returns it.
    ``detected_at``: when the launcher saw the first bad exit (else the watchdog's
    verdict time, if one was recorded)."""
    cause = find_cause(run_dir, exits, first_bad, since, hosts)
    # The last step completed in this attempt. An attempt refused before training trained
    # none: the steps logged meanwhile are those of the job that holds the run (a twin
    # submission). One refused at a save (a full disk) trained up to it: rank 0's
    # ``refused`` record in faults.jsonl says so.
    trained = _refused_in_training(run_dir, since) or not was_refused({"cause": cause})
    reached = _step_reached(run_dir, since) if trained else None
    checkpoint_step = _checkpoint_step(run_dir)
    record = {
        "job_id": job_id,
        "attempt": attempt,
        "exits": {str(k): v for k, v in sorted(exits.items())},
        "ended_by_launcher": sorted(ended_by_launcher or []),
        "cause": cause,
        "step_reached": reached,
        "checkpoint_step": checkpoint_step,
        "work_lost_steps": _work_lost(reached, checkpoint_step),
        "attempt_started": since,
        # the watchdog's verdict when it named the cause, else when the launcher saw it
        "detected_at": cause.pop("verdict_time", None) or detected_at,
    }
    decision, why = decide(failures(run_dir, job_id), record, policy)
    record.update(decision=decision, why=why)
    append_event(run_dir, "failed", **record)
    return record


def _work_lost(reached: int | None, checkpoint_step: int) -> int:
    """Steps trained in the attempt after the checkpoint the run goes on from."""
    return 0 if reached is None else max(0, reached - checkpoint_step)


def record_lost_attempt(run_dir: Path, job_id: str, attempt: int, since: float) -> dict:
    """An attempt that ended without its launcher's record: Slurm lost its node or
    allocation (NODE_FAIL) and requeued the job itself (``--requeue``), so no teardown ran.
    The watchdog's verdict, if a surviving rank gave one, names the lost rank."""
    cause = find_cause(run_dir, {}, None, since)
    note = "the allocation was lost and Slurm requeued the job itself"
    if cause.get("rank") is None and not cause.get("phase"):
        cause = {"rank": None, "reason": f"ended without a record: {note}"}
    else:
        cause["reason"] = f"{cause.get('reason')}; {note}"
    reached = _step_reached(run_dir, since)
    checkpoint_step = _checkpoint_step(run_dir)
    record = {
        "job_id": job_id,
        "attempt": attempt,
        "exits": {},
        "cause": cause,
        "step_reached": reached,
        "checkpoint_step": checkpoint_step,
        "work_lost_steps": _work_lost(reached, checkpoint_step),
        "attempt_started": since,
        "detected_at": cause.pop("verdict_time", None),
        "decision": "relaunch",
        "why": "requeued by Slurm (node failure)",
    }
    append_event(run_dir, "failed", **record)
    return record


def summary_line(record: dict) -> str:
    """``rank 1 on node2 killed by signal 9 (SIGKILL) after step 140``."""
    cause = record.get("cause", {})
    who = f"rank {cause['rank']}" if cause.get("rank") is not None else "the job"
    if cause.get("host"):
        who += f" on {cause['host']}"
    reached = record.get("step_reached")
    if was_refused(record):
        where = " before training" if reached is None else f" after step {reached}"
    elif cause.get("step") is not None:  # the rank's own (or its watchdog's) word
        where = f" in phase {cause.get('phase') or '?'} of step {cause['step']}"
    elif reached is not None:
        where = f" after step {reached}"
    else:
        where = " before its first step"
    return f"{who} {cause.get('reason', 'failed')}{where}"


def attempt_line(record: dict) -> str:
    """One failed attempt: what ended it, what came next, the steps it lost."""
    if record.get("decision") == "relaunch":
        then = f"restarted from step {record['checkpoint_step']}"
    elif was_refused(record):  # the summary says so; the why would repeat it
        then = "not relaunched: a relaunch cannot change a refusal"
    else:
        then = f"not relaunched: {record.get('why')}"
    lost = record.get("work_lost_steps")
    trained = record.get("step_reached") is not None  # else it lost nothing
    return f"attempt {record.get('attempt')}: {summary_line(record)}; {then}" + (
        f" ({lost} steps since the last checkpoint lost)" if trained else ""
    )


def relaunch_summary(records: list[dict]) -> str:
    """How a job's failed attempts went on, for ``status``: only relaunched attempts'
    steps were redone."""
    relaunched = [r for r in records if r.get("decision") == "relaunch"]
    redone = sum(r.get("work_lost_steps") or 0 for r in relaunched)
    if not relaunched:
        return "not relaunched" if len(records) == 1 else "none relaunched"
    if len(relaunched) == len(records):
        return f"{redone} steps redone in all"
    return f"{len(relaunched)} relaunched ({redone} steps redone in all)"


# -- Slurm: the batch script's step after srun -------------------------------------------

_SRUN_LINE = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.*)$")


def srun_exits(text: str) -> tuple[dict[int, int], list[int], dict[int, str]]:
    """Task exits from srun's lines (``srun: error: node2: task 1: Killed``), the order in
    which they came, and each task's node."""
    exits: dict[int, int] = {}
    order: list[int] = []
    hosts: dict[int, str] = {}
    for line in text.splitlines():
        match = _SRUN_LINE.match(line.strip())
        if not match:
            continue
        node, tasks, what = match.groups()
        code = _srun_code(what)
        if code is None:
            continue
        for task in _expand(tasks):
            if task not in exits:
                exits[task], hosts[task] = code, node
                order.append(task)
    return exits, order, hosts


def _srun_code(what: str) -> int | None:
    if what.startswith("Exited with exit code"):
        return int(what.rsplit(" ", 1)[-1])
    names = {"Killed": 9, "Terminated": 15, "Aborted": 6, "Segmentation fault": 11}
    for name, number in names.items():
        if what.startswith(name):
            return -number
    return None


def _expand(tasks: str) -> list[int]:
    out = []
    for part in tasks.split(","):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


def teardown_lines(python: str, folder: Path) -> list[str]:
    """The batch script's lines after srun: record a failed attempt, requeue to relaunch."""
    return [
        "cqk_srun_exit=$?  # srun's, kept for the step below",
        f"{python} -m launch.attempts after-srun {shlex.quote(str(folder))} $cqk_srun_exit",
    ]


def _slurm_job_id() -> str:
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID", "0")


def after_srun(folder: Path, srun_exit: int) -> int:
    """Called by the batch script: a failed step is recorded and requeued (or not)."""
    from submitit.core import utils

    job_id = _slurm_job_id()
    paths = utils.JobPaths(folder, job_id)
    submission = utils.DelayedSubmission.load(paths.submitted_pickle)
    job = submission.function
    config = job.run_config()
    run_dir = Path(config.log.root) / config.name
    if srun_exit == 0 or runs.is_finished(run_dir, config.train.train_steps):
        return srun_exit
    log = paths.stderr
    text = log.read_text(errors="replace") if log.is_file() else ""
    text = text.rsplit(MARKER, 1)[-1]  # this attempt's lines only
    exits, order, hosts = srun_exits(text)
    bad = [task for task in order if is_bad_exit(exits[task])]
    if not bad and srun_exit in (EXIT_REQUEUE, LOCAL_REQUEUE):
        return srun_exit  # stopped to requeue: rank 0 has seen to it
    attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0) + 1
    started = [
        e for e in events(run_dir) if e.get("event") == "started" and str(e.get("job_id")) == job_id
    ]
    since = started[-1]["time"] if started else time.time() - 1e9
    record = record_failure(
        run_dir,
        job_id,
        attempt,
        exits or {-1: srun_exit},
        bad[0] if bad else None,
        since,
        Policy(job.max_restarts, job.max_identical_failures),
        hosts,
    )
    print(f"cqk-attempt: {attempt_line(record)}", file=sys.stderr, flush=True)
    if record["decision"] != "relaunch":
        print(f"cqk-attempt: stopping: {record['why']}", file=sys.stderr, flush=True)
        return srun_exit or 1
    out = subprocess.run(
        ["scontrol", "requeue", os.environ.get("SLURM_JOB_ID", job_id)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        print(f"cqk-attempt: scontrol requeue failed: {out.stderr.strip()}", file=sys.stderr)
        return srun_exit or 1
    print(f"cqk-attempt: requeued job {job_id} on {socket.gethostname()}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.attempts")
    sub = parser.add_subparsers(dest="command", required=True)
    after = sub.add_parser("after-srun", help="the batch script's step after srun")
    after.add_argument("folder", type=Path)
    after.add_argument("srun_exit", type=int)
    args = parser.parse_args(argv)
    return after_srun(args.folder, args.srun_exit)


if __name__ == "__main__":
    sys.exit(main())
