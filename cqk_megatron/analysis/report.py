"""The analysis of a set of runs, and its Markdown report with PNG figures.

``analyze`` runs every fit and comparison that the data allow (a variant with too few
sizes or budgets gets a note instead of a fit); ``write_report`` writes ``report.md``,
``figures/*.png``, the tidy table ``runs.csv`` and ``fits.json`` into one folder.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from cqk_megatron.analysis import compare, plots
from cqk_megatron.analysis.fits import (
    PARAMS,
    Bootstrap,
    FitError,
    bootstrap_chinchilla,
    bootstrap_compute_law,
)
from cqk_megatron.analysis.ingest import Ingested, fit_points, humanize_count, run_summary

LADDER_SIZES = (60e6, 150e6, 350e6, 1e9, 3e9, 7e9)
COMPUTE_BUDGETS = (1e19, 1e20, 1e21, 1e22, 1e23)
DEFAULT_CROSSOVERS = (("differential", "coupled"),)
FIT_POINTS = {
    "final": "the final evaluation of each finished run",
    "all": "every validation evaluation past 20% of its run's tokens",
}


@dataclass
class Options:
    points: str = "all"  # all | final (see ingest.fit_points)
    n_column: str = "params_non_embedding"  # or params_total
    n_boot: int = 200
    level: float = 0.95
    tokens_per_param: float = compare.TOKENS_PER_PARAM
    baseline: str = "standard"
    crossovers: tuple = DEFAULT_CROSSOVERS
    seed: int = 0


@dataclass
class Analysis:
    ingested: Ingested
    options: Options
    runs: pd.DataFrame
    points: pd.DataFrame
    fits: dict[str, Bootstrap] = field(default_factory=dict)
    compute_fits: dict[str, Bootstrap] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    multipliers: dict[str, pd.DataFrame] = field(default_factory=dict)
    crossovers: dict[tuple[str, str], compare.Crossover] = field(default_factory=dict)
    seed_variance: pd.DataFrame | None = None
    gains: pd.DataFrame | None = None


def multiplier_sizes(points: pd.DataFrame, options: Options) -> tuple[list[float], float]:
    """One N per measured size (the baseline's, else the smallest variant's), plus the
    ladder sizes up to 30x beyond the largest (extrapolating further says nothing); and
    the largest measured N."""
    per_size = points.groupby(["size", "variant"])[options.n_column].min().unstack("variant")
    measured = per_size.get(options.baseline, per_size.min(axis=1)).fillna(per_size.min(axis=1))
    largest = float(measured.max())
    extra = [s for s in LADDER_SIZES if largest * 1.01 < s <= 30 * largest]
    return sorted(float(n) for n in measured) + extra, largest


def analyze(ingested: Ingested, options: Options | None = None) -> Analysis:
    options = options or Options()
    table = ingested.table
    analysis = Analysis(ingested, options, run_summary(table), fit_points(table, options.points))
    points = analysis.points
    for variant, rows in points.groupby("variant"):
        try:
            analysis.fits[variant] = bootstrap_chinchilla(
                rows[options.n_column],
                rows["tokens"],
                rows["loss"],
                groups=rows["run"],
                n_boot=options.n_boot,
                seed=options.seed,
            )
        except FitError as error:
            analysis.notes.append(f"no L(N, D) fit for {variant}: {error}")
    valid = table[table["split"] == "valid"]
    for variant, rows in valid.groupby("variant"):
        try:
            analysis.compute_fits[variant] = bootstrap_compute_law(
                rows["flops"],
                rows["loss"],
                groups=rows["run"],
                n_boot=options.n_boot,
                seed=options.seed,
            )
        except FitError as error:
            analysis.notes.append(f"no L(C) fit for {variant}: {error}")

    baseline = analysis.fits.get(options.baseline)
    if baseline is not None:
        sizes, largest = multiplier_sizes(points, options)
        for variant, fit in analysis.fits.items():
            if variant != options.baseline:
                frame = compare.multiplier_vs_size(
                    fit, baseline, sizes, options.tokens_per_param, options.level
                )
                frame["extrapolated"] = frame["params"] > largest * 1.01
                analysis.multipliers[variant] = frame
    for challenger, incumbent in options.crossovers:
        if challenger in analysis.fits and incumbent in analysis.fits:
            analysis.crossovers[(challenger, incumbent)] = compare.crossover_with_uncertainty(
                analysis.fits[challenger],
                analysis.fits[incumbent],
                options.tokens_per_param,
                options.level,
            )
    # Seeds and sizes compare like with like: finished runs only (a preempted run's last
    # evaluation is at fewer tokens).
    finished = analysis.runs[analysis.runs["finished"]] if not analysis.runs.empty else None
    if finished is not None and not finished.empty:
        analysis.seed_variance = compare.seed_variance(finished, options.baseline)
        finals = finished.dropna(subset=["final_val_loss"]).rename(
            columns={"params_total": "params"}
        )
        if options.baseline in set(finals["variant"]):
            gains = compare.percent_change_table(finals, options.baseline, metric="final_val_ppl")
            # Throughput beside quality: the paper's gain came at ~2.4x step time.
            speed = finals.groupby(["size", "variant"])["tokens_per_s"].median()
            gains["tokens_per_s"] = [
                speed.get((s, v)) for s, v in zip(gains["size"], gains["variant"], strict=True)
            ]
            base = gains[gains["variant"] == options.baseline].set_index("size")["tokens_per_s"]
            gains["step_time_ratio"] = gains["size"].map(base) / gains["tokens_per_s"]
            analysis.gains = gains
    return analysis


# ---------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------


def markdown_table(frame: pd.DataFrame, formats: dict | None = None) -> str:
    """A GitHub Markdown table; ``formats`` maps a column to a format function."""
    formats = formats or {}
    if frame.empty:
        return "_(none)_"
    header = "| " + " | ".join(map(str, frame.columns)) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    lines = [header, rule]
    for _, row in frame.iterrows():
        cells = []
        for column in frame.columns:
            value = row[column]
            if column in formats:
                cells.append(formats[column](value))
            elif isinstance(value, float):
                cells.append("" if math.isnan(value) else f"{value:.4g}")
            else:
                cells.append(str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _count(value) -> str:
    return humanize_count(float(value)) if pd.notna(value) else ""


def _times(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return "∞" if math.isinf(value) else f"{value:.2f}×"


def _with_interval(point: float, interval: tuple[float, float], fmt: str = "{:.3g}") -> str:
    low, high = interval
    if math.isnan(low):
        return fmt.format(point)
    return f"{fmt.format(point)} [{fmt.format(low)}, {fmt.format(high)}]"


def _fits_table(analysis: Analysis) -> pd.DataFrame:
    rows = []
    for variant, boot in analysis.fits.items():
        row = {"variant": variant, "points": boot.point.n_points}
        for name in PARAMS:
            row[name] = _with_interval(
                getattr(boot.point, name), boot.interval(name, analysis.options.level)
            )
        row["replicates"] = f"{len(boot.samples)} (+{boot.failed} unfit)"
        rows.append(row)
    return pd.DataFrame(rows)


def _compute_table(analysis: Analysis) -> pd.DataFrame:
    rows = []
    level = analysis.options.level
    for variant, boot in analysis.compute_fits.items():
        rows.append(
            {
                "variant": variant,
                "frontier points": boot.point.n_points,
                "E (nats)": _with_interval(boot.point.E, boot.interval("E", level)),
                "A": f"{boot.point.A:.3g}",
                "a": _with_interval(boot.point.a, boot.interval("a", level)),
            }
        )
    return pd.DataFrame(rows)


def _optimal_table(analysis: Analysis) -> pd.DataFrame:
    rows = []
    for variant, boot in analysis.fits.items():
        fit = boot.point
        a_exp, b_exp = fit.exponents
        for budget in COMPUTE_BUDGETS:
            n_opt, d_opt = fit.compute_optimal(budget)
            rows.append(
                {
                    "variant": variant,
                    "compute (FLOPs)": f"{budget:.0e}",
                    "N_opt (params)": humanize_count(float(n_opt)),
                    "D_opt (tokens)": humanize_count(float(d_opt)),
                    "tokens/param": f"{float(d_opt / n_opt):.1f}",
                    "loss (nats)": f"{float(fit.predict(n_opt, d_opt)):.3f}",
                    "N ~ C^a, D ~ C^b": f"a={a_exp:.2f}, b={b_exp:.2f}",
                }
            )
    return pd.DataFrame(rows)


def _multiplier_table(analysis: Analysis) -> pd.DataFrame:
    rows = []
    for variant, frame in analysis.multipliers.items():
        for _, row in frame.iterrows():
            rows.append(
                {
                    "variant": variant,
                    "N (params)": humanize_count(row["params"]),
                    "D (tokens)": humanize_count(row["tokens"]),
                    "multiplier": _times(row["multiplier"]),
                    f"{analysis.options.level:.0%} interval": (
                        f"{_times(row['low'])} – {_times(row['high'])}"
                    ),
                    "": "extrapolated" if row["extrapolated"] else "measured size",
                }
            )
    return pd.DataFrame(rows)


def _relative(path: Path, folder: Path) -> str:
    return os.path.relpath(path, folder).replace(os.sep, "/")


def render_markdown(analysis: Analysis, figures: dict[str, Path], folder: Path) -> str:
    o, ingested, runs = analysis.options, analysis.ingested, analysis.runs
    partial = int((~runs["finished"]).sum()) if not runs.empty else 0
    n_name = "non-embedding" if o.n_column == "params_non_embedding" else "total"
    out = [
        "# Scaling analysis",
        "",
        f"{len(runs)} runs ({partial} partial), {len(ingested.skipped)} skipped. "
        f"Fits use {FIT_POINTS[o.points]}; "
        f"N counts {n_name} parameters, D tokens, losses are in nats per token. "
        f"Intervals: {o.level:.0%} bootstrap percentiles over {o.n_boot} resamples of runs.",
        "",
        "## Runs",
        "",
        markdown_table(
            runs[
                [
                    "run",
                    "variant",
                    "size",
                    "seed",
                    "params_non_embedding",
                    "tokens",
                    "steps",
                    "final_val_loss",
                    "final_val_ppl",
                    "tokens_per_s",
                    "finished",
                ]
            ].rename(
                columns={"params_non_embedding": "non-emb params", "tokens_per_s": "tokens/s"}
            ),
            {
                "non-emb params": _count,
                "tokens": _count,
                "final_val_loss": lambda v: f"{v:.4f}" if pd.notna(v) else "",
                "final_val_ppl": lambda v: f"{v:.2f}" if pd.notna(v) else "",
                "tokens/s": lambda v: f"{v:,.0f}" if pd.notna(v) else "",
            },
        ),
        "",
    ]
    if analysis.gains is not None:
        gains = analysis.gains[
            ["size", "variant", "value", "percent", "n", "tokens_per_s", "step_time_ratio"]
        ].rename(
            columns={
                "value": "final val. ppl",
                "percent": f"vs {o.baseline}",
                "n": "seeds",
                "tokens_per_s": "tokens/s",
                "step_time_ratio": f"step time / {o.baseline}",
            }
        )
        out += [
            f"## Perplexity against {o.baseline} attention, per size",
            "",
            markdown_table(
                gains,
                {
                    "final val. ppl": "{:.2f}".format,
                    f"vs {o.baseline}": "{:+.1f}%".format,
                    "tokens/s": lambda v: f"{v:,.0f}" if pd.notna(v) else "",
                    f"step time / {o.baseline}": lambda v: f"{v:.2f}×" if pd.notna(v) else "",
                },
            ),
            "",
        ]
    out += ["## Loss curves", "", f"![loss curves]({_relative(figures['curves'], folder)})", ""]
    out += ["## Scaling-law fits: L(N, D) = E + A/N^α + B/D^β", ""]
    if analysis.fits:
        out += [markdown_table(_fits_table(analysis)), ""]
    else:
        out += ["_No fit: the runs need at least 2 sizes and 2 token counts (see notes)._", ""]
    if "fits" in figures:
        out += [f"![fits]({_relative(figures['fits'], folder)})", ""]
    out += ["## Loss vs compute: L(C) = E + A·C^-a (C in FLOPs, on the compute frontier)", ""]
    if analysis.compute_fits:
        out += [markdown_table(_compute_table(analysis)), ""]
    else:
        out += ["_No fit: it needs at least 4 distinct compute points per variant._", ""]
    if "frontier" in figures:
        out += [f"![frontier]({_relative(figures['frontier'], folder)})", ""]
    if analysis.fits:
        out += [
            "## Compute-optimal allocation (C = 6·N·D)",
            "",
            markdown_table(_optimal_table(analysis)),
            "",
        ]
    if analysis.multipliers:
        out += [
            f"## Data-efficiency multiplier over {o.baseline} attention",
            "",
            f"Tokens {o.baseline} attention needs to reach the variant's loss, over the "
            f"variant's tokens, at D = {o.tokens_per_param:g} tokens per parameter "
            "(∞: standard never reaches it at that size).",
            "",
            markdown_table(_multiplier_table(analysis)),
            "",
        ]
        if "multiplier" in figures:
            out += [f"![multiplier]({_relative(figures['multiplier'], folder)})", ""]
    if analysis.crossovers:
        out += ["## Crossover", ""]
        for (challenger, incumbent), cross in analysis.crossovers.items():
            where = (
                f"at N ≈ {humanize_count(cross.size)} parameters"
                if cross.size
                else f"nowhere between {humanize_count(compare.SEARCH_RANGE[0])} and "
                f"{humanize_count(compare.SEARCH_RANGE[1])} parameters"
            )
            interval = (
                f"{humanize_count(cross.low)} – {humanize_count(cross.high)}"
                if not math.isnan(cross.low)
                else "n/a"
            )
            out.append(
                f"- **{challenger}** overtakes **{incumbent}** {where} (D = "
                f"{o.tokens_per_param:g}·N); {o.level:.0%} interval {interval}; "
                f"{cross.fraction_crossing:.0%} of {cross.replicates} bootstrap replicates cross."
            )
        out.append("")
    if analysis.seed_variance is not None and (analysis.seed_variance["seeds"] > 1).any():
        sv = analysis.seed_variance[analysis.seed_variance["seeds"] > 1]
        out += [
            "## Seed variance",
            "",
            markdown_table(
                sv[
                    [
                        "size",
                        "variant",
                        "seeds",
                        "mean_loss",
                        "std_loss",
                        "mean_ppl",
                        "ppl_range",
                        "variance_ratio",
                    ]
                ].rename(columns={"variance_ratio": f"var / {o.baseline} var"}),
                {
                    "std_loss": "{:.4f}".format,
                    "mean_loss": "{:.4f}".format,
                    "mean_ppl": "{:.2f}".format,
                    "ppl_range": "{:.2f}".format,
                },
            ),
            "",
        ]
    problems = [f"- skipped `{s.path}`: {s.reason}" for s in ingested.skipped]
    problems += [f"- {w}" for w in ingested.warnings] + [f"- {n}" for n in analysis.notes]
    if problems:
        out += ["## Skipped runs, warnings and notes", "", *problems, ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------


def _write_text(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def fits_json(analysis: Analysis) -> dict:
    level = analysis.options.level
    return {
        "chinchilla": {
            v: {
                **b.point.params(),
                "intervals": {p: b.interval(p, level) for p in PARAMS},
                "replicates": len(b.samples),
            }
            for v, b in analysis.fits.items()
        },
        "compute": {
            v: {"E": b.point.E, "A": b.point.A, "a": b.point.a}
            for v, b in analysis.compute_fits.items()
        },
        "multipliers": {v: f.to_dict(orient="records") for v, f in analysis.multipliers.items()},
        "crossovers": {f"{c}>{i}": vars(x) for (c, i), x in analysis.crossovers.items()},
        "notes": analysis.notes,
    }


def write_report(analysis: Analysis, folder: str | Path) -> Path:
    """Write report.md, figures/*.png, runs.csv and fits.json into ``folder``."""
    folder = Path(folder)
    figures_dir = folder / "figures"
    figures_dir.mkdir(parents=True, exist_ok=True)
    table = analysis.ingested.table
    figures = {"curves": plots.loss_curves(table, figures_dir / "loss_curves.png")}
    if not analysis.points.empty:
        figures["fits"] = plots.chinchilla_fits(
            analysis.points,
            {v: b.point for v, b in analysis.fits.items()},
            figures_dir / "fits_loss_vs_tokens.png",
            analysis.options.n_column,
        )
        valid = table[table["split"] == "valid"]
        figures["frontier"] = plots.compute_frontier(
            valid,
            {v: b.point for v, b in analysis.compute_fits.items()},
            figures_dir / "loss_vs_compute.png",
        )
    if analysis.multipliers:
        figures["multiplier"] = plots.multiplier_vs_size(
            analysis.multipliers,
            figures_dir / "multiplier_vs_size.png",
            analysis.options.tokens_per_param,
        )
    table.to_csv(folder / "runs.csv.tmp", index=False)
    os.replace(folder / "runs.csv.tmp", folder / "runs.csv")
    _write_text(folder / "fits.json", json.dumps(fits_json(analysis), indent=2, default=_jsonable))
    report = folder / "report.md"
    _write_text(report, render_markdown(analysis, figures, folder))
    return report


def _jsonable(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, np.bool_):
        return bool(value)
    return str(value)
