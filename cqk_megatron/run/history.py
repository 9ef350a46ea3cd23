"""The run's history (``history.jsonl``): the settings each attempt of a run trained under,
and the step from which they held. Torch-free, like the rest of the run contract.

One JSON object a line, one per attempt that trained at least one step, written by rank 0
after that step (``record_attempt``, which also replaces ``config.yaml`` with the same
config, so that neither ever names settings under which no step ran):

    {"start_step": 100, "time": 1760000000.0, "job_id": "4242",
     "changes": [{"key": "parallel.tensor_parallel", "old": 1, "new": 2}],
     "config": {...the resolved config, as config.yaml holds it...}}

An attempt trains the steps after ``start_step`` (a metrics record of step ``n`` is
attempt ``a``'s when ``a.start_step < n`` and no later attempt starts before ``n``). An
attempt that restarts at or before an earlier one's start (a resume from an older
checkpoint) supersedes it, as its metrics supersede that attempt's records: the file keeps
the attempts whose steps the run's records hold. ``changes`` lists what differs from the
previous attempt (the ones a resume takes: layout, engine, ZeRO stage, batch split, the
learning-rate tail; see ``cqk_megatron.config.changes``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cqk_megatron.config import ConfigError, RunConfig, from_dict, to_dict
from cqk_megatron.config.changes import LOCATION_KEYS, Change, changes
from cqk_megatron.run.atomic import write_text_atomically
from cqk_megatron.run.folder import HISTORY, read_jsonl, write_config
from cqk_megatron.run.unwritable import no_space_error


@dataclass(frozen=True)
class Attempt:
    """One attempt of a run: the steps after ``start_step`` trained under ``config``."""

    start_step: int
    config: dict[str, Any]  # the resolved config, as ``to_dict`` gives it
    changes: list[dict[str, Any]] = field(default_factory=list)  # {key, old, new} vs the previous
    time: float = 0.0
    job_id: str | None = None

    def run_config(self) -> RunConfig:
        return from_dict(RunConfig, self.config, source=HISTORY)

    def record(self) -> dict[str, Any]:
        return {
            "start_step": self.start_step,
            "time": self.time,
            "job_id": self.job_id,
            "changes": self.changes,
            "config": self.config,
        }


def _attempt(record: dict[str, Any]) -> Attempt | None:
    step, config = record.get("start_step"), record.get("config")
    if not isinstance(step, int) or not isinstance(config, dict):
        return None
    return Attempt(
        start_step=step,
        config=config,
        changes=list(record.get("changes") or []),
        time=float(record.get("time") or 0.0),
        job_id=record.get("job_id"),
    )


def read_history(run_dir: Path) -> list[Attempt]:
    """The attempts of the run in ``run_dir``, oldest first (none for a run that has not
    trained a step, or was trained before runs kept a history)."""
    attempts: list[Attempt] = []
    for record in read_jsonl(Path(run_dir) / HISTORY):
        attempt = _attempt(record)
        if attempt is None:
            continue
        attempts = [a for a in attempts if a.start_step < attempt.start_step]
        attempts.append(attempt)
    return attempts


def attempt_of_step(attempts: list[Attempt], step: int) -> Attempt | None:
    """The attempt that trained step ``step`` (1-based, as metrics records count)."""
    found = [a for a in attempts if a.start_step < step]
    return found[-1] if found else None


def settings_label(config: RunConfig) -> str:
    """The settings a resume may change, in a few words: engine, ZeRO stage, layout,
    micro-batch and precision (e.g. ``deepspeed zero1 tp2 pp1 mbs2 fp32``)."""
    t, p = config.train, config.parallel
    return (
        f"{t.engine} zero{t.zero_stage} tp{p.tensor_parallel} pp{p.pipeline_parallel} "
        f"mbs{t.micro_batch_size} {t.precision}"
    )


def readable_config(attempt: Attempt) -> RunConfig | None:
    """The attempt's config, or None where this version cannot read it (a key renamed
    since): its record stays as written, and the next one lists no changes."""
    try:
        return attempt.run_config()
    except ConfigError:
        return None


def _job_id() -> str | None:
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or None


def _listed(found: list[Change]) -> list[dict[str, Any]]:
    return [{"key": c.key, "old": c.old, "new": c.new} for c in found]


def record_attempt(run_dir: Path, config: RunConfig, start_step: int) -> Attempt:
    """Rank 0, after this attempt's first step: its record in ``history.jsonl`` (what it
    supersedes dropped) and its config in ``config.yaml``, both atomically."""
    run_dir = Path(run_dir)
    kept = [a for a in read_history(run_dir) if a.start_step < start_step]
    found = []
    previous = readable_config(kept[-1]) if kept else None
    if previous is not None:
        found = [c for c in changes(previous, config) if c.key not in LOCATION_KEYS]
    attempt = Attempt(start_step, to_dict(config), _listed(found), time.time(), _job_id())
    text = "".join(json.dumps(a.record(), default=str) + "\n" for a in [*kept, attempt])
    try:
        write_text_atomically(run_dir / HISTORY, text)
    except OSError as error:
        raise no_space_error(run_dir / HISTORY, error) from error
    write_config(run_dir, config)
    return attempt
