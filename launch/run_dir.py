"""A run folder as the launcher sees it: ``log.root/name`` holding

- ``config.yaml``: the resolved run config (written at the first submission; replaced
  only when a job really starts the run, so a refused attempt does not rewrite it);
- ``jobs.jsonl``: one JSON line per event: ``submitted`` (by the launcher: job id, cluster,
  resources, submitit folder), ``started`` (by the job's rank 0: attempt, hosts, the
  rendezvous, log paths, the ``SLURM_*`` environment), ``stopped``/``finished`` (exit code
  and what happened about the requeue), ``refused``/``failed`` (why the job would not
  start or could not go on), ``cancelled`` (by ``submit.py cancel``);
- ``lease.json``: the live job holding the run (``cqk_megatron.run_lease``);
- ``metrics.jsonl`` and ``checkpoints/`` (the training loop's), ``submitit/`` (job logs).

Metrics are read through ``cqk_megatron.training.metrics.read_metrics``, the one reader
that analysis and repro use too: at most one record per step and kind.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from cqk_megatron.atomic import write_text_atomically
from cqk_megatron.config import RunConfig, to_dict
from cqk_megatron.run_folder import METRICS
from cqk_megatron.training.metrics import read_metrics

JOBS = "jobs.jsonl"


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it."""
    write_text_atomically(path, text)


def write_config(run_dir: Path, config: RunConfig) -> None:
    write_atomically(run_dir / "config.yaml", yaml.safe_dump(to_dict(config), sort_keys=False))


def append_event(run_dir: Path, event: str, **fields) -> None:
    """One line in ``jobs.jsonl``; a single ``write`` of a short line, so concurrent
    writers (the launcher, a job) do not interleave."""
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"event": event, "time": time.time(), **fields}
    with (run_dir / JOBS).open("a") as file:
        file.write(json.dumps(record, default=str) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """The readable records of a JSON-lines file (a line cut short by a crash is skipped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def events(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / JOBS)


def last_submission(run_dir: Path) -> dict | None:
    submitted = [e for e in events(run_dir) if e["event"] == "submitted"]
    return submitted[-1] if submitted else None


def metrics(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / METRICS).records


def summary(run_dir: Path) -> dict | None:
    """The training loop's closing ``summary`` record, if the run got that far."""
    records = [r for r in metrics(run_dir) if r.get("kind") == "summary"]
    return records[-1] if records else None


def is_finished(run_dir: Path, train_steps: int) -> bool:
    """Finished: a summary line for at least ``train_steps`` steps (a run whose
    ``train.train_steps`` was raised since is not finished)."""
    record = summary(run_dir)
    return record is not None and int(record.get("steps", 0)) >= train_steps


def latest_train_record(run_dir: Path) -> dict | None:
    records = [r for r in metrics(run_dir) if r.get("kind") == "train"]
    return records[-1] if records else None


def latest_valid_record(run_dir: Path) -> dict | None:
    records = [r for r in metrics(run_dir) if r.get("kind") == "valid"]
    return records[-1] if records else None


def latest_checkpoint(run_dir: Path) -> str | None:
    latest = run_dir / "checkpoints" / "latest"
    if latest.is_file():
        return latest.read_text().strip() or None
    return None
