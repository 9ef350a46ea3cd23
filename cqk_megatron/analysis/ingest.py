"""Read run folders into one tidy table.

A run folder (written by the training engine) holds ``config.yaml`` (the resolved
``RunConfig``) and ``metrics.jsonl`` (``train`` lines, ``valid`` lines, and a ``summary``
line when the run finished). wandb offline run folders (``wandb/offline-run-*``) are read
too, when no ``metrics.jsonl`` sits above them. Bad runs are reported and skipped; a
preempted run (no summary, maybe a truncated last line) is kept and marked partial.

The table has one row per logged loss: ``run, variant, seed, size, shape, params_total,
params_non_embedding, flops_per_token, split ("train" | "valid"), step, tokens, flops,
loss, final, lr, tokens_per_s, step_time_s, process_cpu_s, time, finished, source``
(``tokens_per_s`` and ``step_time_s`` are wall clock; ``process_cpu_s`` is the training
process's cumulative CPU time, see ``step_time``), and the settings the row's step ran
under: ``attempt`` (which attempt of the run trained it, from 0) and ``settings`` (that
attempt's engine, ZeRO stage, layout, micro-batch and precision), read from the run's
``history.jsonl`` (``cqk_megatron.run.history``); a run without one (or a wandb run) has
one attempt, its ``config.yaml``'s. FLOPs are
``flops_per_token * tokens`` where the run's summary gives ``flops_per_token``, else
``6 * params_total * tokens`` (the usual estimate; ``flops_source`` says which).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from cqk_megatron.analysis import wandb_runs
from cqk_megatron.analysis.step_time import run_step_time
from cqk_megatron.config import ConfigError, RunConfig, from_dict, load_config
from cqk_megatron.model.params import vocabulary_parameters
from cqk_megatron.planner.parameters import config_parameters
from cqk_megatron.run.folder import (
    CONFIG,
    METRICS,
    STEP_KINDS,
    SUMMARY,
    TRAIN,
    VALID,
    run_status,
)
from cqk_megatron.run.folder import read_metrics as read_metrics_file
from cqk_megatron.run.history import (
    Attempt,
    attempt_of_step,
    read_history,
    readable_config,
    settings_label,
)

REQUIRED = {TRAIN: ("step", "tokens", "loss"), VALID: ("step", "tokens", "val_loss")}
COLUMNS = [
    "run",
    "variant",
    "seed",
    "size",
    "shape",
    "params_total",
    "params_non_embedding",
    "flops_per_token",
    "flops_source",
    "split",
    "step",
    "tokens",
    "flops",
    "loss",
    "final",
    "lr",
    "tokens_per_s",
    "step_time_s",
    "process_cpu_s",
    "time",
    "finished",
    "source",
    "attempt",
    "settings",
]


class RunError(ValueError):
    """This folder is not a usable run; the message says why and what to do."""


@dataclass
class Skipped:
    path: str
    reason: str


@dataclass
class Ingested:
    table: pd.DataFrame
    skipped: list[Skipped] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def runs(self) -> pd.DataFrame:
        return run_summary(self.table)


# ---------------------------------------------------------------------------------------
# parameter counts
# ---------------------------------------------------------------------------------------

_PARAM_CACHE: dict[str, int] = {}


def count_total_parameters(config: RunConfig) -> int:
    """Total parameters of the run's model (TP=PP=1), counted without building it or
    starting a process group (``planner.parameters.config_parameters``)."""
    key = repr((config.model, config.attention))
    if key not in _PARAM_CACHE:
        # Only the model and attention sections decide the count; the run's layout,
        # engine (GPU-only ones fail validation here) and batch sizes must not get in
        # the way on an analysis machine.
        config = RunConfig(name=config.name, model=config.model, attention=config.attention)
        _PARAM_CACHE[key] = config_parameters(config)
    return _PARAM_CACHE[key]


def shape_key(config: RunConfig) -> str:
    m = config.model
    return (
        f"L{m.num_layers}-H{m.hidden_size}-A{m.num_attention_heads}-G{m.kv_heads}"
        f"-F{m.ffn_size}-V{m.padded_vocab_size}"
    )


def humanize_count(count: float) -> str:
    """58466816 -> '58M', 1.2e9 -> '1.2B'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(count) >= scale:
            value = count / scale
            return f"{value:.2g}{suffix}" if value < 10 else f"{value:.0f}{suffix}"
    return f"{count:.0f}"


# ---------------------------------------------------------------------------------------
# reading one run
# ---------------------------------------------------------------------------------------


def read_metrics(path: Path) -> tuple[list[dict], list[str]]:
    """Parse ``metrics.jsonl`` through the training side's one reader (one record per step
    and kind: what a resumed attempt logged again supersedes the earlier attempt's): the
    good lines, and a problem per line that was not."""
    found = read_metrics_file(path)
    lines, problems = [], list(found.problems)
    for line in found.records:
        kind = line.get("kind")
        missing = [key for key in REQUIRED.get(kind, ()) if line.get(key) is None]
        if missing:
            step = line.get("step")
            problems.append(f"{path}: {kind} line at step {step} lacks {missing}; skipped")
            continue
        lines.append(line)
    return lines, problems


@dataclass
class RunRecord:
    path: str
    config: RunConfig
    lines: list[dict]
    finished: bool
    source: str
    problems: list[str]
    state: str = ""  # the run contract's state (``run_status``); wandb: finished or partial
    why: str = ""  # for a failed run: what ended it
    history: list[Attempt] = field(default_factory=list)  # the attempts that trained steps


def read_run_dir(path: Path) -> RunRecord:
    config_path, metrics_path = path / CONFIG, path / METRICS
    if not metrics_path.is_file():
        raise RunError(f"{path}: no {METRICS} (has the run logged a step yet?)")
    if not config_path.is_file():
        raise RunError(f"{path}: no {CONFIG}; the engine writes the resolved config there")
    try:
        config = load_config(config_path)
    except ConfigError as error:
        raise RunError(f"{path}: unreadable config: {error}") from error
    lines, problems = read_metrics(metrics_path)
    status = run_status(path)
    return RunRecord(
        str(path),
        config,
        lines,
        status.finished,
        "jsonl",
        problems,
        status.state,
        status.why,
        read_history(path),
    )


def record_from_wandb(run: dict, path: str) -> RunRecord:
    try:
        config = from_dict(RunConfig, run["config"], source=f"{path} (wandb config)")
    except ConfigError as error:
        raise RunError(f"{path}: the wandb config is not a RunConfig: {error}") from error
    lines = wandb_runs.history_to_metrics(run["history"])
    summary = wandb_runs.summary_line(run["summary"], run["config"])
    if summary is not None and run["finished"]:
        lines.append(summary)
    state = "finished" if run["finished"] else "partial"
    return RunRecord(path, config, lines, run["finished"], "wandb", list(run["problems"]), state)


def read_wandb_dir(path: Path) -> RunRecord:
    try:
        run = wandb_runs.read_offline_run(path)
    except wandb_runs.WandbUnavailable as error:
        raise RunError(str(error)) from error
    return record_from_wandb(run, str(path))


def _finite(value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan
    return number if math.isfinite(number) else math.nan


def _attempt_of(record: RunRecord, step: int) -> tuple[int, str]:
    """Which attempt of the run trained ``step``, and the settings it ran under (a valid
    record of step ``step`` evaluates the weights that attempt trained)."""
    found = attempt_of_step(record.history, step)
    if found is None:
        return 0, settings_label(record.config)
    config = readable_config(found) or record.config
    return record.history.index(found), settings_label(config)


def record_rows(record: RunRecord) -> tuple[list[dict], list[str]]:
    """One row per train/valid line of a run, with its parameter counts."""
    config, problems = record.config, list(record.problems)
    summaries = [line for line in record.lines if line.get("kind") == SUMMARY]
    summary = summaries[-1] if summaries else {}
    total = summary.get("params_total")
    non_embedding = summary.get("params_non_embedding")
    if total is None:
        try:
            total = count_total_parameters(config)
        except Exception as error:  # a model that cannot be built is a bad run, not a crash
            raise RunError(
                f"{record.path}: cannot count parameters from the config: {error}"
            ) from error
    if non_embedding is None:
        non_embedding = total - vocabulary_parameters(config)
    flops_per_token = summary.get("flops_per_token")
    base = {
        "run": config.name,
        "variant": config.attention.variant,
        "seed": config.seed,
        "shape": shape_key(config),
        "params_total": int(total),
        "params_non_embedding": int(non_embedding),
        "flops_per_token": float(flops_per_token) if flops_per_token else math.nan,
        "flops_source": "summary" if flops_per_token else "6ND",
        "finished": record.finished,
        "source": record.path,
    }
    rows, dropped = [], 0
    # A run resumed from a checkpoint logs the steps after it again: the later line of a
    # (kind, step) is the one the finished run stands on; keep it alone.
    latest = {(line.get("kind"), line.get("step")): line for line in record.lines}
    for line in record.lines:
        kind = line.get("kind")
        if kind not in STEP_KINDS or latest[(kind, line.get("step"))] is not line:
            continue
        attempt, settings = _attempt_of(record, int(line["step"]))
        loss = _finite(line["loss"] if kind == TRAIN else line["val_loss"])
        if math.isnan(loss):
            dropped += 1
            continue
        tokens = float(line["tokens"])
        flops = (
            float(flops_per_token) * tokens
            if flops_per_token
            else 6.0 * base["params_total"] * tokens
        )
        rows.append(
            {
                **base,
                "split": kind,
                "step": int(line["step"]),
                "tokens": tokens,
                "flops": flops,
                "loss": loss,
                "final": bool(line.get("final", False)),
                "lr": _finite(line.get("lr")),
                "tokens_per_s": _finite(line.get("tokens_per_s")),
                "step_time_s": _finite(line.get("step_time_s")),
                "process_cpu_s": _finite(line.get("process_cpu_s")),
                "time": _finite(line.get("time")),
                "attempt": attempt,
                "settings": settings,
            }
        )
    if dropped:
        problems.append(f"{record.path}: {dropped} non-finite loss value(s) dropped")
    if not rows:
        raise RunError(f"{record.path}: no train or valid lines with a finite loss")
    if record.state == "failed":
        problems.append(f"{record.path}: failed run (no summary line; {record.why})")
    elif not record.finished:
        problems.append(f"{record.path}: partial run (no summary line: preempted or running)")
    return rows, problems


# ---------------------------------------------------------------------------------------
# finding runs and building the table
# ---------------------------------------------------------------------------------------


def find_runs(paths: list[str | Path]) -> tuple[list[tuple[str, Path]], list[Skipped]]:
    """``("jsonl" | "wandb", folder)`` for every run under ``paths``.

    A folder with ``metrics.jsonl`` is a run and is not searched further (its
    checkpoints and wandb folder belong to it); wandb offline folders count only
    outside such runs. A folder with a ``config.yaml`` but no metrics is reported.
    """
    found: list[tuple[str, Path]] = []
    skipped: list[Skipped] = []
    for root in map(Path, paths):
        if not root.exists():
            skipped.append(Skipped(str(root), "does not exist"))
            continue
        for folder, subfolders, files in os.walk(root):
            here = Path(folder)
            if METRICS in files:
                found.append(("jsonl", here))
                subfolders[:] = []
            elif wandb_runs.is_offline_run_dir(here):
                found.append(("wandb", here))
                subfolders[:] = []
            elif CONFIG in files and here.name not in ("files",) and not _in_checkpoint(here):
                skipped.append(Skipped(str(here), f"{CONFIG} but no {METRICS} yet"))
            subfolders.sort()
    return found, skipped


def _in_checkpoint(folder: Path) -> bool:
    return any(part.startswith(("iter_", "checkpoint")) for part in folder.parts)


def build_table(rows: list[dict]) -> pd.DataFrame:
    table = pd.DataFrame(rows, columns=COLUMNS)
    if table.empty:
        return table
    # A size label per model shape, from its smallest variant's count: variants of one
    # shape differ by ~0.1% parameters and must land in the same size group.
    labels = table.groupby("shape")["params_total"].transform("min").map(humanize_count)
    table["size"] = labels
    return table.sort_values(
        ["params_total", "variant", "seed", "run", "split", "step"]
    ).reset_index(drop=True)


def ingest(paths: list[str | Path], wandb_project: str | None = None) -> Ingested:
    """Every run under ``paths`` (and, optionally, a wandb project through the API)."""
    found, skipped = find_runs(paths)
    rows: list[dict] = []
    warnings: list[str] = []
    readers = {"jsonl": read_run_dir, "wandb": read_wandb_dir}
    # (where, how to read it): reading is deferred so one bad run is caught and reported
    records: list[tuple[str, Callable[[], RunRecord]]] = [
        (str(folder), functools.partial(readers[kind], folder)) for kind, folder in found
    ]
    if wandb_project:
        try:
            for run in wandb_runs.read_api_runs(wandb_project):
                records.append(
                    (run["path"], functools.partial(record_from_wandb, run, run["path"]))
                )
        except Exception as error:  # no key, no network: say so, keep the local runs
            skipped.append(Skipped(f"wandb:{wandb_project}", str(error)))
    seen_names: dict[str, str] = {}
    for path, read in records:
        try:
            record = read()
            run_rows, problems = record_rows(record)
        except (RunError, OSError) as error:
            skipped.append(Skipped(path, str(error)))
            continue
        name = run_rows[0]["run"]
        if name in seen_names:
            skipped.append(Skipped(path, f"duplicate run name '{name}' (also {seen_names[name]})"))
            continue
        seen_names[name] = path
        rows.extend(run_rows)
        warnings.extend(problems)
    return Ingested(build_table(rows), skipped, warnings)


# ---------------------------------------------------------------------------------------
# views of the table
# ---------------------------------------------------------------------------------------


def _settings_by_steps(rows: pd.DataFrame) -> str:
    """The settings each attempt of a run trained under, with its steps: ``deepspeed zero1
    tp1 pp1 mbs2 fp32 (steps 1-100); deepspeed zero2 tp2 ... (steps 101-200)``."""
    train = rows[rows["split"] == "train"]
    if train.empty:
        train = rows
    parts = []
    for _, attempt in train.groupby("attempt", sort=True):
        first, last = int(attempt["step"].min()), int(attempt["step"].max())
        parts.append(f"{attempt['settings'].iloc[0]} (steps {first}-{last})")
    return "; ".join(parts)


def run_summary(table: pd.DataFrame) -> pd.DataFrame:
    """One row per run: counts, tokens seen, last validation loss, throughput (wall
    clock), CPU seconds per step (``step_time``), status, and the settings each of its
    attempts trained under (from its history)."""
    if table.empty:
        return pd.DataFrame()
    valid = table[table["split"] == "valid"].sort_values("step")
    train = table[table["split"] == "train"]
    last_valid = valid.groupby("run").tail(1).set_index("run")
    first = table.groupby("run").first()
    step_times = {run: run_step_time(rows) for run, rows in train.groupby("run")}
    step_time = pd.DataFrame(
        {
            "cpu_s_per_step": {run: t.cpu for run, t in step_times.items()},
            "cpu_s_first_half": {run: t.first_half for run, t in step_times.items()},
            "cpu_s_second_half": {run: t.second_half for run, t in step_times.items()},
        }
    ).reindex(first.index)
    summary = pd.DataFrame(
        {
            "variant": first["variant"],
            "size": first["size"],
            "seed": first["seed"],
            "params_total": first["params_total"],
            "params_non_embedding": first["params_non_embedding"],
            "tokens": table.groupby("run")["tokens"].max(),
            "steps": table.groupby("run")["step"].max(),
            "final_val_loss": last_valid["loss"],
            "final_val_ppl": last_valid["loss"].map(math.exp),
            "final_eval": last_valid["final"],
            "tokens_per_s": train.groupby("run")["tokens_per_s"].median(),
            **{column: step_time[column] for column in step_time.columns},
            "finished": first["finished"],
            "settings": {run: _settings_by_steps(rows) for run, rows in table.groupby("run")},
        }
    )
    summary.index.name = "run"
    return (
        summary.reset_index()
        .sort_values(["params_total", "variant", "seed"])
        .reset_index(drop=True)
    )


def fit_points(table: pd.DataFrame, points: str = "all", min_fraction: float = 0.2) -> pd.DataFrame:
    """Validation points for the fits.

    ``final``: each finished run's last evaluation (Chinchilla's approach 3 proper; needs
    several token budgets per size). ``all``: every evaluation past ``min_fraction`` of the
    run's tokens, so that one budget per size still spans the D axis (intermediate
    points of a cosine schedule sit slightly above a run tuned for that D).
    """
    valid = table[table["split"] == "valid"].copy()
    if valid.empty:
        return valid
    if points == "final":
        valid = valid[valid["finished"]]
        return valid.sort_values("step").groupby("run").tail(1).reset_index(drop=True)
    if points != "all":
        raise ValueError(f"points must be 'all' or 'final', got {points!r}")
    longest = valid.groupby("run")["tokens"].transform("max")
    return valid[valid["tokens"] >= min_fraction * longest].reset_index(drop=True)
