"""The run contract: the files of a run folder ``log.root/name``, what their records are,
and what state a run is in. Training writes the folder; launch, repro, analysis and
convert read it through this module. Torch-free: they read run folders without Megatron.

The files (each name defined here and nowhere else):

- ``config.yaml`` (``CONFIG``): the resolved config of the run's last attempt that
  trained a step, replaced after that step (``history.record_attempt``), so that it never
  names settings under which no step ran: a refused attempt, one that fails before its
  first step and a resubmission of a finished run leave it as it was;
- ``history.jsonl`` (``HISTORY``): every attempt's settings and the step from which they
  held (``cqk_megatron.run.history``);
- ``metrics.jsonl`` (``METRICS``): rank 0's records, one JSON object a line, each with a
  ``kind`` (``RECORD_KINDS``): ``train`` and ``valid`` per logged step, and ``summary``
  once, when the run has trained all of its ``train.train_steps`` and evaluated. Written by
  ``cqk_megatron.training.metrics.MetricsLogger``, read by ``read_metrics`` (at most one
  record per step and kind: what a resumed attempt logged again supersedes the earlier);
- ``jobs.jsonl`` (``JOBS``): the launcher's and the job's events, one a line
  (``append_event``; ``submitted``, ``started``, ``stopped``, ``finished``, ``refused``,
  ``failed``, ``cancelled``, ...; see ``launch/run_dir.py`` and ``launch/attempts.py``);
- ``faults.jsonl`` (``FAULTS``): the watchdog's crash records and verdicts
  (``cqk_megatron.training.resilience.watchdog``);
- ``lease.json`` (``LEASE``): which process holds the run (``cqk_megatron.run.lease``);
- ``checkpoints/`` (``CHECKPOINTS``): ``cqk_megatron.run.checkpoint_files`` owns the names in
  it (``iter_NNNNNNN``, ``manifest.json``, ``latest``);
- ``superseded/<UTC time>/`` (``SUPERSEDED``): what a run moved out of the way instead of
  deleting it (checkpoints newer than the one it resumed from, or everything on
  ``--resume none``);
- ``submitit/`` (``SUBMITIT``): the job logs of the launcher;
- ``wandb_id`` (``WANDB_ID``): the run's wandb id (``wandb_run_id``), made at the run's
  first start and kept by its requeues and resumes, so that they log to one wandb run; a
  run of the same name in another folder, or ``--resume none``, gets a new one.

A run's state (``run_status``), the one definition that ``launch status``, the launcher,
repro and analysis use:

- ``finished``: ``metrics.jsonl`` holds a summary record (as ``read_metrics`` reads it: a
  summary that later steps were logged after is stale and dropped), and, when the caller
  asks for ``train_steps`` (the launcher, for the config it would run now), one for at
  least that many steps: a run whose ``train.train_steps`` was raised since is not
  finished. Finished wins over everything below.
- ``failed``: not finished, and nothing will carry the run on by itself. With launcher
  events (``jobs.jsonl``): the last ``failed`` event after the last ``submitted`` or
  ``started`` one has no ``relaunch`` decision (``launch/attempts.py`` decided ``stop``:
  its restart budget spent, the same failure again, or a refusal before training, exit
  2, which a relaunch cannot change; or rank 0 recorded a failure, a checkpoint it could
  not save, and no relaunch decision came after). Without launcher events (a plain
  ``cqk train``, a repro run): ``faults.jsonl`` holds a crash record or a watchdog
  verdict. Either way the failure must be newer than the last metrics record: a run that
  logs after it goes on (a resume of a crashed plain run), and so does a run whose lease a
  live job holds other than the one that failed (a twin submission refused because that
  job held the folder: it is that job's refusal, not the run's end, also before the
  holder logs its next step). A bare ``refused`` event decides nothing: it is one job's
  refusal, and under the launcher its ``failed`` record follows.
- ``partial``: started (a metrics record, a checkpoint folder or a ``started`` event),
  neither finished nor failed: running, preempted, stopped to requeue, cancelled.
- ``new``: nothing of the above yet (a folder with at most a config and a submission).

The other facts of the contract have one home each, beside this module: checkpoint names
in ``cqk_megatron.run.checkpoint_files``, exit codes in ``cqk_megatron.errors``, the
rendezvous-port rule in ``cqk_megatron.parallel.ports``, atomic writes (with the umask's
permissions) in ``cqk_megatron.run.atomic``.
"""

from __future__ import annotations

import json
import os
import secrets
import string
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from cqk_megatron.config import RunConfig, to_dict
from cqk_megatron.run.atomic import append_line, write_text_atomically
from cqk_megatron.run.lease import LEASE, live_holder
from cqk_megatron.run.unwritable import no_space_error

CONFIG = "config.yaml"
HISTORY = "history.jsonl"
METRICS = "metrics.jsonl"
JOBS = "jobs.jsonl"
FAULTS = "faults.jsonl"
CHECKPOINTS = "checkpoints"
SUPERSEDED = "superseded"
SUBMITIT = "submitit"
WANDB_ID = "wandb_id"

# The ``kind`` of a metrics record.
TRAIN, VALID, SUMMARY = "train", "valid", "summary"
STEP_KINDS = (TRAIN, VALID)  # one per logged step
RECORD_KINDS = (TRAIN, VALID, SUMMARY)

State = Literal["new", "partial", "finished", "failed"]
STATES: tuple[State, ...] = ("new", "partial", "finished", "failed")


def run_dir_of(config: RunConfig) -> Path:
    return Path(config.log.root) / config.name


def wandb_run_id(run_dir: Path) -> str:
    """This run folder's wandb id: the one ``wandb_id`` holds, or a new one (8 random
    base-36 digits, as wandb makes them) written there first. Rank 0, at the run's start."""
    path = Path(run_dir) / WANDB_ID
    if path.is_file() and (recorded := path.read_text().strip()):
        return recorded
    alphabet = string.ascii_lowercase + string.digits
    new = "".join(secrets.choice(alphabet) for _ in range(8))
    try:
        write_text_atomically(path, new + "\n")
    except OSError as error:
        raise no_space_error(path, error) from error
    return new


def write_config(run_dir: Path, config: RunConfig) -> None:
    """``config.yaml``, atomically (a reader never sees half of it)."""
    text = yaml.safe_dump(to_dict(config), sort_keys=False)
    try:
        write_text_atomically(run_dir / CONFIG, text)
    except OSError as error:
        raise no_space_error(run_dir / CONFIG, error) from error


def supersede(run_dir: Path, paths: list[Path]) -> Path | None:
    """Move ``paths`` (inside ``run_dir``) to ``run_dir/superseded/<UTC time>/``, keeping
    their relative paths; renames only (instant, nothing copied, nothing deleted)."""
    paths = [p for p in paths if p.exists()]
    if not paths:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = run_dir / SUPERSEDED / stamp
    suffix = 1
    while target.exists():
        suffix += 1
        target = run_dir / SUPERSEDED / f"{stamp}-{suffix}"
    for path in paths:
        destination = target / path.relative_to(run_dir)
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, destination)
    return target


# -- JSON-lines files ----------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The readable records of a JSON-lines file (a line cut short by a crash is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def append_event(run_dir: Path, event: str, **fields: Any) -> None:
    """One line in ``jobs.jsonl``, whole or not at all (``atomic.append_line``); a
    filesystem that refuses it raises ``NoSpaceError`` naming it."""
    run_dir = Path(run_dir)
    record = {"event": event, "time": time.time(), **fields}
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        append_line(run_dir / JOBS, json.dumps(record, default=str))
    except OSError as error:
        raise no_space_error(run_dir / JOBS, error) from error


def events(run_dir: Path) -> list[dict[str, Any]]:
    """The events of ``jobs.jsonl`` (each with an ``event`` name), in order."""
    return [e for e in read_jsonl(Path(run_dir) / JOBS) if "event" in e]


# -- metrics.jsonl -------------------------------------------------------------------------


@dataclass
class MetricsFile:
    """What ``read_metrics`` found: records in order, and a problem per unreadable line."""

    records: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    superseded: int = 0  # records dropped because a later attempt logged their steps again


def records_up_to(records: list[dict[str, Any]], start_step: int) -> list[dict[str, Any]]:
    """Records of an attempt that (re)started at ``start_step``: the earlier ones up to it
    (and no summary)."""
    kept = []
    for record in records:
        if record.get("kind") == SUMMARY:
            continue
        step = record.get("step")
        if isinstance(step, int) and step > start_step:
            continue
        kept.append(record)
    return kept


def read_metrics(path: Path) -> MetricsFile:
    """The records of ``metrics.jsonl`` with at most one per (kind, step): a train record
    whose step is not past the previous one starts a new attempt, which supersedes every
    record from that step on (and any summary before it)."""
    result = MetricsFile()
    path = Path(path)
    if not path.is_file():
        return result
    raw = path.read_text(errors="replace").splitlines()
    records: list[dict[str, Any]] = []
    last_train = 0
    for number, text in enumerate(raw, start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            where = "last line (truncated: run preempted?)" if number == len(raw) else "line"
            result.problems.append(f"{path}:{number}: {where} is not valid JSON; skipped")
            continue
        if not isinstance(record, dict):
            result.problems.append(f"{path}:{number}: not a JSON object; skipped")
            continue
        step = record.get("step")
        if record.get("kind") in STEP_KINDS and any(r.get("kind") == SUMMARY for r in records):
            # steps logged after a summary: the run was continued, that summary is stale
            before = len(records)
            records = [r for r in records if r.get("kind") != SUMMARY]
            result.superseded += before - len(records)
        if record.get("kind") == TRAIN and isinstance(step, int):
            if step <= last_train:
                before = len(records)
                records = records_up_to(records, step - 1)
                result.superseded += before - len(records)
            last_train = step
        elif record.get("kind") in STEP_KINDS and isinstance(step, int):
            same = [
                i
                for i, r in enumerate(records)
                if r.get("kind") == record["kind"] and r.get("step") == step
            ]
            for i in reversed(same):
                del records[i]
            result.superseded += len(same)
        records.append(record)
    result.records = records
    return result


def last_record(records: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    """The last record of ``kind`` (``TRAIN``, ``VALID``, ``SUMMARY``), or None."""
    found = [r for r in records if r.get("kind") == kind]
    return found[-1] if found else None


# -- the state of a run --------------------------------------------------------------------

# Launcher events after which a run goes on: a new job, or one of its attempts, starting.
_STARTS = ("submitted", "started")


@dataclass(frozen=True)
class RunStatus:
    """Where a run stands (see the module's docstring for what each state means)."""

    state: State
    summary: dict[str, Any] | None = None  # the summary record, when there is one
    why: str = ""  # for ``failed``: what ended it (the launcher's or the watchdog's words)

    @property
    def finished(self) -> bool:
        return self.state == "finished"


def _launcher_failure(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``failed`` event that ended the run for good, if the launcher recorded one."""
    last_start = max((i for i, e in enumerate(history) if e["event"] in _STARTS), default=-1)
    failures = [e for e in history[last_start + 1 :] if e["event"] == "failed"]
    if failures and failures[-1].get("decision") != "relaunch":
        return failures[-1]
    return None


def _held_by_another_job(run_dir: Path, failure: dict[str, Any]) -> bool:
    """A live process holds the run's lease and is not of the job that ``failure`` ended."""
    holder = live_holder(run_dir)
    return holder is not None and holder.job_id != str(failure.get("job_id"))


def _fault(run_dir: Path) -> dict[str, Any] | None:
    """The last crash record, watchdog verdict or refusal (a full disk at a save) in
    ``faults.jsonl``."""
    faults = [
        r
        for r in read_jsonl(run_dir / FAULTS)
        if r.get("event") in ("crashed", "lost", "rendezvous", "refused")
    ]
    return faults[-1] if faults else None


def _time(record: dict[str, Any]) -> float:
    value = record.get("time")
    return float(value) if isinstance(value, int | float) else 0.0


def _why(record: dict[str, Any]) -> str:
    """The launcher's or the watchdog's words for what ended the run, on one line."""
    text = record.get("why") or record.get("reason") or record.get("line")
    if not text and record.get("error"):  # a rank's crash record
        text = f"rank {record.get('rank')} crashed at step {record.get('step')}: {record['error']}"
    text = str(text or record["event"])
    return text.splitlines()[0] if text else ""


def run_status(run_dir: Path, train_steps: int | None = None) -> RunStatus:
    """The state of the run in ``run_dir``: ``finished`` (for at least ``train_steps``
    steps, when given), ``failed``, ``partial`` or ``new``."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / METRICS).records
    summary = last_record(records, SUMMARY)
    if summary is not None and (
        train_steps is None or int(summary.get("steps") or 0) >= train_steps
    ):
        return RunStatus("finished", summary)
    history = events(run_dir)
    failure = _launcher_failure(history) if history else _fault(run_dir)
    if failure is not None and history and _held_by_another_job(run_dir, failure):
        failure = None  # that job's refusal (or failure); the holder carries the run on
    logged = max(map(_time, records), default=0.0)
    if failure is not None and _time(failure) >= logged:
        return RunStatus("failed", summary, _why(failure))
    checkpoints = run_dir / CHECKPOINTS
    started = (
        bool(records)
        or (checkpoints.is_dir() and any(checkpoints.iterdir()))
        or any(e["event"] == "started" for e in history)
    )
    return RunStatus("partial" if started else "new", summary)


# -- recognising a run folder --------------------------------------------------------------

# The files only a run writes (``config.yaml`` aside: other tools write files of that name,
# and a run that wrote it has written ``checkpoints/`` and ``metrics.jsonl`` before it).
_RUN_FILES = (CHECKPOINTS, METRICS, HISTORY, JOBS, FAULTS, LEASE, SUPERSEDED)


def run_folder_file(folder: Path) -> str | None:
    """The first of the files only a run writes that ``folder`` holds (what makes it a run
    folder), or None. Tools that replace a folder (``cqk convert ... --overwrite``) refuse
    one where this is not None."""
    folder = Path(folder)
    return next((name for name in _RUN_FILES if (folder / name).exists()), None)
