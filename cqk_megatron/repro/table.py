"""The comparison: one row per variant (seeds pooled), written as Markdown, CSV and JSON,
and the loss-vs-tokens figure, from the runs' folders through the analysis tools.

Columns: final validation perplexity (mean over seeds, min-max and standard deviation),
its change against standard attention (%, from ``analysis.compare.percent_change_table``),
the change seed by seed, the spread between seeds and whether the change is inside it,
median tokens/s (wall clock, for the record), CPU seconds per step and the step-time ratio
against standard from it (same seed, then averaged; ``analysis.step_time``: flagged when
unsteady, or when only wall clock exists), parameters, tokens, and whether every variant
of a seed saw the same first batch (its sha256).

The spread between seeds is the larger of standard's and the variant's perplexity range
over seeds, in % of standard's mean; a change no larger than it is "inside the spread":
what the seeds alone moved, as large as the change, so it cannot be told from seed noise.
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
from cqk_megatron.analysis.step_time import CPU_CLOCK, format_ratio, step_time_ratios
from cqk_megatron.repro.configs import Reproduction
from cqk_megatron.repro.presets import ReproError
from cqk_megatron.run.atomic import write_text_atomically
from cqk_megatron.run.folder import run_status

BASELINE = "standard"
COLUMNS = [
    "variant",
    "seeds",
    "val_ppl",
    "val_ppl_min",
    "val_ppl_max",
    "val_ppl_std",
    "change_vs_standard_pct",
    "change_by_seed_pct",
    "seed_spread_pct",
    "change_inside_seed_spread",
    "tokens_per_s",
    "cpu_s_per_step",
    "step_time_vs_standard",
    "step_time_clock",
    "step_time_steady",
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


def per_run(reproduction: Reproduction) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the analysis' tidy table of the reproduction's runs, one row per run with its
    fingerprint)."""
    ingested = ingest([run.run_dir for run in reproduction.runs])
    runs = ingested.runs.set_index("run")
    rows = []
    for run in reproduction.runs:
        summary = run_status(run.run_dir).summary or {}
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
                "cpu_s_per_step": float(row["cpu_s_per_step"]),
                "cpu_s_first_half": float(row["cpu_s_first_half"]),
                "cpu_s_second_half": float(row["cpu_s_second_half"]),
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
    has_baseline = BASELINE in change.index
    # step time seed by seed (same data order, same machine), then averaged
    ratios = step_time_ratios(runs, BASELINE, by="seed")
    base = runs[runs["variant"] == BASELINE]
    base_ppl = base.set_index("seed")["val_ppl"]
    base_range = float(base["val_ppl"].max() - base["val_ppl"].min()) if has_baseline else 0.0
    rows = []
    for variant in variants:
        mine = runs[runs["variant"] == variant]
        speed = ratios[ratios["variant"] == variant].dropna(subset=["ratio"])
        by_seed = [
            100 * (ppl / base_ppl[seed] - 1)
            for seed, ppl in zip(mine["seed"], mine["val_ppl"], strict=True)
            if seed in base_ppl.index
        ]
        percent = change.loc[variant, "percent"] if has_baseline else math.nan
        seeds = min(len(mine), len(base))
        if has_baseline and seeds > 1:
            own_range = float(mine["val_ppl"].max() - mine["val_ppl"].min())
            spread = 100 * max(base_range, own_range) / change.loc[BASELINE, "value"]
            inside = abs(percent) <= spread
        else:
            spread, inside = math.nan, math.nan  # one seed: the spread is not measured
        rows.append(
            {
                "variant": variant,
                "seeds": ",".join(str(s) for s in mine["seed"]),
                "val_ppl": change.loc[variant, "value"],
                "val_ppl_min": change.loc[variant, "low"],
                "val_ppl_max": change.loc[variant, "high"],
                "val_ppl_std": mine["val_ppl"].std(ddof=1) if len(mine) > 1 else math.nan,
                "change_vs_standard_pct": percent,
                "change_by_seed_pct": ",".join(f"{c:+.2f}" for c in by_seed),
                "seed_spread_pct": spread,
                "change_inside_seed_spread": inside,
                "tokens_per_s": mine["tokens_per_s"].mean(),
                "cpu_s_per_step": mine["cpu_s_per_step"].mean(),
                "step_time_vs_standard": speed["ratio"].mean() if len(speed) else math.nan,
                "step_time_clock": (
                    CPU_CLOCK
                    if len(speed) and (speed["clock"] == CPU_CLOCK).all()
                    else "wall clock"
                ),
                "step_time_steady": bool(len(speed) and speed["steady"].all()),
                "params_total": int(mine["params_total"].iloc[0]),
                "tokens": int(mine["tokens"].iloc[0]),
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def confidence_lines(table: pd.DataFrame) -> list[str]:
    """A sentence per variant: its change, the spread between seeds, inside or outside."""
    lines = []
    for _, row in table[table["variant"] != BASELINE].iterrows():
        change = row["change_vs_standard_pct"]
        if isinstance(change, float) and math.isnan(change):
            continue
        head = f"- **{row['variant']}**: {change:+.2f}% perplexity against {BASELINE}"
        if row["change_by_seed_pct"] and "," in row["change_by_seed_pct"]:
            head += f" (seed by seed: {row['change_by_seed_pct'].replace(',', '%, ')}%)"
        spread = row["seed_spread_pct"]
        if isinstance(spread, float) and math.isnan(spread):
            lines.append(
                head + "; from one seed each, the spread between seeds is not measured, so "
                "this change cannot be told from seed noise (run more --seeds)."
            )
        elif row["change_inside_seed_spread"]:
            lines.append(
                head + f"; the seeds alone spread perplexity over {spread:.2f}% of "
                f"{BASELINE}'s, so the change is inside the spread between seeds: it cannot "
                "be told from seed noise."
            )
        else:
            lines.append(
                head + f"; the seeds alone spread perplexity over {spread:.2f}% of "
                f"{BASELINE}'s, so the change is outside the spread between seeds (with "
                f"{len(row['seeds'].split(','))} seeds, a hint rather than a significance test)."
            )
    return lines


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
    """The per-variant table as Markdown, numbers rounded for reading, then a sentence per
    variant on its change and the seeds' spread, and what the step-time column rests on."""
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
            "seed spread": table["seed_spread_pct"].map(lambda v: _fmt(v, ".2f", "%")),
            "tokens/s (wall)": table["tokens_per_s"].map(lambda v: _fmt(v, ",.0f")),
            "CPU s/step": table["cpu_s_per_step"].map(lambda v: _fmt(v, ".3f")),
            "step time vs standard": [
                format_ratio(r, c, bool(st))
                for r, c, st in zip(
                    table["step_time_vs_standard"],
                    table["step_time_clock"],
                    table["step_time_steady"],
                    strict=True,
                )
            ],
            "params": table["params_total"].map(lambda v: f"{v:,}"),
        }
    )
    clock = (
        "Step time vs standard is the ratio of CPU seconds per step (the training process's "
        "CPU time: other work on a shared machine moves it far less than wall clock, "
        "though shared caches and cores still do), seed by seed; 'unsteady' when its two "
        "halves disagree by more than 5%."
        if (table["step_time_clock"] == CPU_CLOCK).all()
        else "Step time vs standard is marked 'wall clock, unreliable' where the runs' records "
        "hold no process CPU time: on a shared machine wall clock measures the machine's "
        "load as much as the model (measure with cqk bench --clock cpu)."
    )
    lines = confidence_lines(table)
    return "\n".join([markdown_table(shown), "", *lines, *([""] if lines else []), clock])


def render_markdown(
    reproduction: Reproduction, table: pd.DataFrame, runs: pd.DataFrame, same: dict
) -> str:
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
    t = reproduction.runs[0].config.train
    schedule = t.schedule
    lines = [
        f"# Attention variants compared: preset `{reproduction.preset.name}`",
        "",
        f"Model: {reproduction.preset.description}. Data: {reproduction.data.description}, prefix "
        f"`{reproduction.data.prefix}`, tokenizer `{reproduction.data.tokenizer}` "
        f"({reproduction.data.vocab_size} tokens). Every run: {reproduction.steps:,} steps x "
        f"{reproduction.tokens_per_step:,} tokens = {reproduction.tokens:,} tokens, "
        f"{schedule.decay} schedule (lr {t.optimizer.lr:g} -> {schedule.min_lr:g}, warmup "
        f"{schedule.warmup_steps} steps), {t.precision}, "
        f"{reproduction.nproc} process(es). Hardware: {hardware()}.",
        "",
        "Validation perplexity is the final evaluation on the same held-out batches "
        f"({t.eval_iters} x {t.global_batch_size} sequences of the validation split) for "
        "every run; tokens/s (wall) is the median over logged steps, wall clock, a record of "
        "how long the runs took and not a speed measurement.",
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


def write_comparison(reproduction: Reproduction, command: list[str]) -> Comparison:
    tidy, runs = per_run(reproduction)
    table = compare_variants(runs, reproduction.variants)
    same = same_data_by_seed(runs)
    out = reproduction.out
    markdown, csv, json_path, plot = (
        out / "comparison.md",
        out / "comparison.csv",
        out / "comparison.json",
        out / "loss_vs_tokens.png",
    )
    write_text_atomically(csv, table.to_csv(index=False))
    record = {
        "preset": reproduction.preset.name,
        "command": command,
        "hardware": hardware(),
        "data": {
            "prefix": str(reproduction.data.prefix),
            "tokenizer": str(reproduction.data.tokenizer),
            "description": reproduction.data.description,
        },
        "steps": reproduction.steps,
        "tokens_per_run": reproduction.tokens,
        "same_first_batch_by_seed": {str(k): bool(v) for k, v in same.items()},
        "variants": json.loads(table.to_json(orient="records")),
        "runs": json.loads(runs.to_json(orient="records")),
    }
    write_text_atomically(json_path, json.dumps(record, indent=2) + "\n")
    write_text_atomically(markdown, render_markdown(reproduction, table, runs, same))
    loss_curves(tidy, plot)
    return Comparison(table, runs, same, markdown, csv, json_path, plot)
