"""A run folder as the launcher sees it: the run contract's files
(``cqk_megatron.run.folder``: ``config.yaml``, ``jobs.jsonl``, ``lease.json``,
``metrics.jsonl``, ``checkpoints/``, ``submitit/``) read for the launcher and
``cqk status``.

``jobs.jsonl`` holds one JSON line per event: ``submitted`` (by the launcher: job id,
cluster, resources, submitit folder), ``started`` (by the job's rank 0: attempt, hosts,
the rendezvous, log paths, the ``SLURM_*`` environment), ``stopped``/``finished`` (exit
code and what happened about the requeue), ``refused``/``failed`` (why the job would not
start or could not go on), ``cancelled`` (by ``cqk cancel``).

Whether a run is finished, partial or failed is the contract's ``run_status``; metrics
are read through its ``read_metrics``, the one reader that analysis and repro use too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from cqk_megatron.run import checkpoint_files
from cqk_megatron.run.folder import (
    CHECKPOINTS,
    METRICS,
    SUMMARY,
    TRAIN,
    VALID,
    append_event,
    events,
    last_record,
    read_jsonl,
    read_metrics,
    run_status,
)

__all__ = [
    "append_event",
    "AmbiguousRun",
    "events",
    "find_run",
    "is_finished",
    "job_cancelled",
    "job_refusal",
    "last_submission",
    "latest_checkpoint",
    "latest_train_record",
    "latest_valid_record",
    "metrics",
    "not_found",
    "read_jsonl",
    "remember_run",
    "runs_index",
    "summary",
]


def last_submission(run_dir: Path) -> dict | None:
    submitted = [e for e in events(run_dir) if e["event"] == "submitted"]
    return submitted[-1] if submitted else None


def job_refusal(run_dir: Path, job_id: str) -> str | None:
    """Why job ``job_id`` refused the run, if its last attempt did (a ``refused`` event by
    its rank 0 after the job's last ``started`` one): it trained nothing and is not
    relaunched. None if the job was not refused."""
    history = [e for e in events(run_dir) if str(e.get("job_id")) == str(job_id)]
    starts = [i for i, e in enumerate(history) if e["event"] == "started"]
    since = history[starts[-1] :] if starts else history
    refusals = [e for e in since if e["event"] == "refused"]
    return str(refusals[-1].get("reason") or "refused") if refusals else None


def job_cancelled(run_dir: Path, job_id: str) -> bool:
    """Whether job ``job_id`` was cancelled: by ``cqk cancel`` (its ``cancelled`` event), or
    by a signal to its controller or launcher (a ``stopped`` event whose requeue says
    cancelled). A job that ended that way is reported as cancelled, whatever state its
    backend gives it afterwards (a local job whose ranks saved and exited reads FINISHED)."""
    for event in events(run_dir):
        if str(event.get("job_id")) != str(job_id):
            continue
        if event["event"] == "cancelled" or (
            event["event"] == "stopped" and str(event.get("requeue", "")).startswith("cancelled")
        ):
            return True
    return False


def metrics(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / METRICS).records


def summary(run_dir: Path) -> dict | None:
    """The training loop's closing ``summary`` record, if the run got that far."""
    return last_record(metrics(run_dir), SUMMARY)


def is_finished(run_dir: Path, train_steps: int) -> bool:
    """Finished for ``train_steps`` steps (a run whose ``train.train_steps`` was raised
    since is not): the contract's ``run_status``."""
    return run_status(run_dir, train_steps).finished


def latest_train_record(run_dir: Path) -> dict | None:
    return last_record(metrics(run_dir), TRAIN)


def latest_valid_record(run_dir: Path) -> dict | None:
    return last_record(metrics(run_dir), VALID)


def latest_checkpoint(run_dir: Path) -> str | None:
    """The folder name ``checkpoints/latest`` points at, if any."""
    return checkpoint_files.latest_name(run_dir / CHECKPOINTS)


# -- finding a run by name -------------------------------------------------------------------
#
# A run's folder is log.root/name, and the root may come from a cluster profile
# (launch/resolve.py, runs_root): the launcher notes each folder it submits in an index of
# this account, so that ``status NAME`` and ``cancel NAME`` find it from anywhere.


def runs_index() -> Path:
    """``$XDG_STATE_HOME/cqk-megatron/runs.jsonl`` (default ``~/.local/state/...``)."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "cqk-megatron" / "runs.jsonl"


def remember_run(name: str, run_dir: Path) -> None:
    """Note that run ``name`` is in ``run_dir`` (the launcher, at each submission); a
    failure to write the index only costs ``status NAME`` its shortcut."""
    index = runs_index()
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        with index.open("a") as file:
            file.write(json.dumps({"name": name, "run_dir": str(Path(run_dir).resolve())}) + "\n")
    except OSError as error:
        print(f"note: could not note {name} in {index} ({error})", file=sys.stderr)


class AmbiguousRun(ValueError):
    """A run name that names several run folders submitted from this account."""


def add_runs_argument(parser: argparse.ArgumentParser) -> None:
    """The ``runs`` of ``status`` and ``cancel``: folders, or names ``find_run`` finds."""
    parser.add_argument(
        "runs",
        nargs="+",
        help="run folders (log.root/name), or names of runs submitted from this account",
    )


def find_run(name_or_folder: str) -> Path:
    """A run folder given as a path, or as a run name the launcher submitted from this
    account; the path as given where neither is known. ``AmbiguousRun`` where the name has
    several folders that still exist: the caller asks for the path rather than guessing."""
    path = Path(name_or_folder)
    if path.is_dir() or len(path.parts) != 1:
        return path
    found = [r["run_dir"] for r in read_jsonl(runs_index()) if r.get("name") == name_or_folder]
    existing = list(dict.fromkeys(f for f in found if Path(f).is_dir()))
    if len(existing) > 1:
        listed = "".join(f"\n  {folder}" for folder in existing)
        raise AmbiguousRun(
            f"{name_or_folder}: {len(existing)} run folders of that name were submitted from "
            f"this account:{listed}\ngive the one you mean as a path"
        )
    return Path(existing[0] if existing else found[-1]) if found else path


def not_found(name_or_folder: str) -> str:
    """Why ``name_or_folder`` names no run folder, and where the launcher looked."""
    return (
        f"{name_or_folder}: no such run folder, and no run of that name was submitted from "
        f"this account ({runs_index()}); give the folder, log.root/name"
    )
