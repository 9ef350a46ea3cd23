"""The comparison: one row per variant (seeds pooled), written as Markdown, CSV and JSON,
and the loss-vs-tokens figure, from the runs' folders through the analysis tools.

Columns: final validation perplexity (mean over seeds, min-max and standard deviation),
its change against standard attention (%, from ``analysis.compare.percent_change_table``),
median tokens/s, step-time ratio against standard (same seed, then averaged), parameters,
tokens, and whether every variant of a seed saw the same first batch (its sha256).
"""

from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from cqk_megatron.analysis.compare import percent_change_table
from cqk_megatron.analysis.ingest import ingest
from cqk_megatron.analysis.plots import loss_curves
from cqk_megatron.analysis.report import markdown_table
from cqk_megatron.repro.plan import Plan
from cqk_megatron.repro.presets import ReproError
from cqk_megatron.repro.runner import summary_record

BASELINE = "standard"
COLUMNS = [
    "variant",
    "seeds",
    "val_ppl",
    "val_ppl_min",
    "val_ppl_max",
    "val_ppl_std",
    "change_vs_standard_pct",
    "tokens_per_s",
    "step_time_vs_standard",
    "params_total",
    "tokens",
]


@dataclass
class Comparison:
    table: pd.DataFrame  # one row per variant, COLUMNS
    runs: pd.DataFrame  # one row per run
    same_data: dict[int, bool]  # seed -> every variant saw the same first batch
    markdown: Path
    csv: Path
    json: Path
    plot: Path


def hardware() -> str:
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return f"{torch.cuda.device_count()} x {name} (torch {torch.__version__})"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU: {model}, {cores} cores (torch {torch.__version__})"


def _write(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def per_run(plan: Plan) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the analysis' tidy table of the plan's runs, one row per run with its fingerprint)."""
    ingested = ingest([run.run_dir for run in plan.runs])
    runs = ingested.runs.set_index("run")
    rows = []
    for run in plan.runs:
        summary = summary_record(run.run_dir) or {}
        if run.name not in runs.index:
            reasons = "; ".join(f"{s.path}: {s.reason}" for s in ingested.skipped)
            raise ReproError(f"run {run.name} could not be read for the table ({reasons})")
        row = runs.loc[run.name]
        rows.append(
            {
                "run": run.name,
                "variant": run.variant,
                "seed": run.seed,
                "val_loss": float(row["final_val_loss"]),
                "val_ppl": float(row["final_val_ppl"]),
                "tokens_per_s": float(row["tokens_per_s"]),
                "params_total": int(row["params_total"]),
                "tokens": int(row["tokens"]),
                "first_batch_sha256": summary.get("first_batch_sha256"),
                "folder": str(run.run_dir),
            }
        )
    return ingested.table, pd.DataFrame(rows)


def compare_variants(runs: pd.DataFrame, variants: list[str]) -> pd.DataFrame:
    points = runs.assign(size="all", params=runs["params_total"], ppl=runs["val_ppl"])
    change = percent_change_table(points, baseline=BASELINE, metric="ppl").set_index("variant")
    baseline_speed = runs[runs["variant"] == BASELINE].set_index("seed")["tokens_per_s"]
    rows = []
    for variant in variants:
        mine = runs[runs["variant"] == variant]
        # step time is tokens/s inverted (same tokens a step): ratio taken seed by seed
        ratios = [
            baseline_speed[seed] / speed
            for seed, speed in zip(mine["seed"], mine["tokens_per_s"], strict=True)
            if seed in baseline_speed.index
        ]
        has_baseline = BASELINE in change.index
        rows.append(
            {
                "variant": variant,
                "seeds": ",".join(str(s) for s in mine["seed"]),
                "val_ppl": change.loc[variant, "value"],
                "val_ppl_min": change.loc[variant, "low"],
                "val_ppl_max": change.loc[variant, "high"],
                "val_ppl_std": mine["val_ppl"].std(ddof=1) if len(mine) > 1 else math.nan,
                "change_vs_standard_pct": change.loc[variant, "percent"]
                if has_baseline
                else math.nan,
                "tokens_per_s": mine["tokens_per_s"].mean(),
                "step_time_vs_standard": sum(ratios) / len(ratios) if ratios else math.nan,
                "params_total": int(mine["params_total"].iloc[0]),
                "tokens": int(mine["tokens"].iloc[0]),
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def same_data_by_seed(runs: pd.DataFrame) -> dict[int, bool]:
    return {
        int(seed): rows["first_batch_sha256"].notna().all()
        and rows["first_batch_sha256"].nunique() == 1
        for seed, rows in runs.groupby("seed")
    }


def _fmt(value, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:{spec}}{suffix}"


def variants_markdown(table: pd.DataFrame) -> str:
    """The per-variant table as Markdown, numbers rounded for reading."""
    shown = pd.DataFrame(
        {
            "variant": table["variant"],
            "seeds": table["seeds"],
            "val ppl (mean)": table["val_ppl"].map(lambda v: _fmt(v, ".2f")),
            "spread (min-max)": [
                _fmt(lo, ".2f") + "-" + _fmt(hi, ".2f") if len(s.split(",")) > 1 else "one seed"
                for lo, hi, s in zip(
                    table["val_ppl_min"], table["val_ppl_max"], table["seeds"], strict=True
                )
            ],
            "std": table["val_ppl_std"].map(lambda v: _fmt(v, ".2f")),
            "vs standard": table["change_vs_standard_pct"].map(lambda v: _fmt(v, "+.2f", "%")),
            "tokens/s": table["tokens_per_s"].map(lambda v: _fmt(v, ",.0f")),
            "step time vs standard": table["step_time_vs_standard"].map(
                lambda v: _fmt(v, ".2f", "x")
            ),
            "params": table["params_total"].map(lambda v: f"{v:,}"),
        }
    )
    return markdown_table(shown)


def render_markdown(plan: Plan, table: pd.DataFrame, runs: pd.DataFrame, same: dict) -> str:
    per_run_view = runs[
        ["run", "seed", "val_loss", "val_ppl", "tokens_per_s", "first_batch_sha256"]
    ]
    per_run_view = per_run_view.assign(
        val_loss=per_run_view["val_loss"].map(lambda v: f"{v:.4f}"),
        val_ppl=per_run_view["val_ppl"].map(lambda v: f"{v:.2f}"),
        tokens_per_s=per_run_view["tokens_per_s"].map(lambda v: f"{v:,.0f}"),
        first_batch_sha256=per_run_view["first_batch_sha256"].map(lambda v: (v or "missing")[:16]),
    )
    data_lines = [
        f"- seed {seed}: "
        + ("every variant saw the same first batch" if ok else "**first batches differ**")
        for seed, ok in sorted(same.items())
    ]
    t = plan.runs[0].config.train
    lines = [
        f"# Attention variants compared: preset `{plan.preset.name}`",
        "",
        f"Model: {plan.preset.description}. Data: {plan.data.description}, prefix "
        f"`{plan.data.prefix}`, tokenizer `{plan.data.tokenizer}` "
        f"({plan.data.vocab_size} tokens). Every run: {plan.steps:,} steps x "
        f"{plan.tokens_per_step:,} tokens = {plan.tokens:,} tokens, {t.lr_schedule} schedule "
        f"(lr {t.lr:g} -> {t.min_lr:g}, warmup {t.warmup_steps} steps), {t.precision}, "
        f"{plan.nproc} process(es). Hardware: {hardware()}.",
        "",
        "Validation perplexity is the final evaluation on the same held-out batches "
        f"({t.eval_iters} x {t.global_batch_size} sequences of the validation split) for "
        "every run; tokens/s is the median over logged steps; step time vs standard is "
        "standard's tokens/s over the variant's, seed by seed.",
        "",
        variants_markdown(table),
        "",
        "Same data order (sha256 of the first global batch's tokens):",
        *data_lines,
        "",
        "Runs:",
        "",
        markdown_table(per_run_view),
        "",
        "![validation and training loss against tokens](loss_vs_tokens.png)",
        "",
    ]
    return "\n".join(lines)


def write_comparison(plan: Plan, command: list[str]) -> Comparison:
    tidy, runs = per_run(plan)
    table = compare_variants(runs, plan.variants)
    same = same_data_by_seed(runs)
    out = plan.out
    markdown, csv, json_path, plot = (
        out / "comparison.md",
        out / "comparison.csv",
        out / "comparison.json",
        out / "loss_vs_tokens.png",
    )
    _write(csv, table.to_csv(index=False))
    record = {
        "preset": plan.preset.name,
        "command": command,
        "hardware": hardware(),
        "data": {
            "prefix": str(plan.data.prefix),
            "tokenizer": str(plan.data.tokenizer),
            "description": plan.data.description,
        },
        "steps": plan.steps,
        "tokens_per_run": plan.tokens,
        "same_first_batch_by_seed": {str(k): bool(v) for k, v in same.items()},
        "variants": json.loads(table.to_json(orient="records")),
        "runs": json.loads(runs.to_json(orient="records")),
    }
    _write(json_path, json.dumps(record, indent=2) + "\n")
    _write(markdown, render_markdown(plan, table, runs, same))
    loss_curves(tidy, plot)
    return Comparison(table, runs, same, markdown, csv, json_path, plot)
