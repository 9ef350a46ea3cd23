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
from cqk_megatron.analysis.intervals import NOT_IDENTIFIED, format_interval
from cqk_megatron.analysis.step_time import CPU_CLOCK, format_ratio, step_time_ratios
from cqk_megatron.run.atomic import atomic_path, write_text_atomically

LADDER_SIZES = (60e6, 150e6, 350e6, 1e9, 3e9, 7e9)
MAX_BUDGETS = 6  # compute budgets in the compute-optimal table
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
    # Where the multiplier is read. Always at each measured size's own N and training
    # budget D (the one definition at the measured sizes); "per_param" adds rows from the
    # fits at D = tokens_per_param x N, at the measured sizes and ladder sizes beyond,
    # each labelled as such.
    multiplier_at: str = "measured"
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


MEASURED = "measured: the size's N and training tokens"


def measured_sizes(points: pd.DataFrame, options: Options) -> tuple[list[float], list[float]]:
    """The one place the multiplier is read at the measured sizes: per size, N is the
    baseline's parameter count there (else the smallest variant's) and D the size's
    training budget (the most tokens its baseline runs saw, else any of its runs)."""
    per_size = points.groupby(["size", "variant"])[options.n_column].min().unstack("variant")
    smallest = per_size.min(axis=1)
    sizes = per_size.get(options.baseline, smallest).fillna(smallest).sort_values()
    budgets = points.groupby("size")["tokens"].max()
    baseline_rows = points[points["variant"] == options.baseline]
    budgets.update(baseline_rows.groupby("size")["tokens"].max())
    return [float(n) for n in sizes], [float(budgets[s]) for s in sizes.index]


def per_param_sizes(measured: list[float]) -> tuple[list[float], list[float]]:
    """Sizes for the rows read at D = tokens_per_param x N: the measured ones, and the
    ladder sizes up to 30x beyond the largest (further says nothing)."""
    largest = max(measured)
    return measured, [s for s in LADDER_SIZES if largest * 1.01 < s <= 30 * largest]


def multipliers(
    fit: Bootstrap, baseline: Bootstrap, points: pd.DataFrame, options: Options
) -> pd.DataFrame:
    """The variant's multiplier over the baseline: at the measured sizes (always), and
    with ``multiplier_at="per_param"`` at D = tokens_per_param x N as well; the
    ``read at`` column says which, ``extrapolated`` marks the rows not at a measured
    (N, D)."""
    if options.multiplier_at not in ("per_param", "measured"):
        raise ValueError(
            f"multiplier_at must be 'per_param' or 'measured', not {options.multiplier_at!r}"
        )
    sizes, budgets = measured_sizes(points, options)
    level, per_param = options.level, options.tokens_per_param
    frame = compare.multiplier_vs_size(fit, baseline, sizes, level=level, tokens=budgets)
    frame["read at"], frame["extrapolated"] = MEASURED, False
    if options.multiplier_at == "measured":
        return frame
    within, beyond = per_param_sizes(sizes)
    frames = [frame, compare.multiplier_vs_size(fit, baseline, within, per_param, level)]
    frames[-1]["read at"] = f"D = {per_param:g}·N, from the fits"
    if beyond:
        # beyond the largest size the fits extrapolate in N: their size terms must hold
        why = fit.point.unidentified("alpha") or baseline.point.unidentified("alpha")
        frames.append(
            compare.multiplier_vs_size(fit, baseline, beyond, per_param, level, unidentified=why)
        )
        frames[-1]["read at"] = f"D = {per_param:g}·N, N beyond the runs"
    for extra in frames[1:]:
        extra["extrapolated"] = True
    return pd.concat(frames, ignore_index=True)


def compute_budgets(points: pd.DataFrame) -> list[float]:
    """Decades of compute from the smallest measured to 100x beyond the largest (at most
    ``MAX_BUDGETS``, the largest kept): where a compute-optimal allocation means
    something for these runs, not a fixed list that a CPU ladder is 8 decades below."""
    flops = points["flops"].dropna()
    if flops.empty:
        return []
    low, high = math.floor(math.log10(flops.min())), math.floor(math.log10(flops.max())) + 2
    return [10.0**k for k in range(max(low, high - MAX_BUDGETS + 1), high + 1)]


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
        for variant, fit in analysis.fits.items():
            if variant != options.baseline:
                analysis.multipliers[variant] = multipliers(fit, baseline, points, options)
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
            # Cost beside quality (the paper's gain came at ~2.4x step time), from a clock
            # that other work on a shared machine barely moves, or flagged (step_time).
            ratios = step_time_ratios(finished, options.baseline).set_index(["size", "variant"])
            keys = list(zip(gains["size"], gains["variant"], strict=True))
            for column in ("cpu_s_per_step", "ratio", "clock", "steady", "note"):
                gains[column] = [ratios[column].get(key) for key in keys]
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


def _fits_table(analysis: Analysis) -> pd.DataFrame:
    rows = []
    for variant, boot in analysis.fits.items():
        row = {"variant": variant, "points": boot.point.n_points, "sizes": boot.point.n_sizes}
        for name in PARAMS:
            row[name] = format_interval(boot.estimate(name, analysis.options.level))
        row["replicates"] = f"{len(boot.samples)} (+{boot.failed} unfit)"
        rows.append(row)
    return pd.DataFrame(rows)


def unidentified_notes(analysis: Analysis) -> list[str]:
    """Why each "not identified" of the fits' table is so, one line per variant."""
    lines = []
    for variant, boot in analysis.fits.items():
        reasons = {}
        for name in PARAMS:
            found = boot.estimate(name, analysis.options.level)
            if not found.identified:
                reasons.setdefault(found.reason, []).append(name)
        lines += [f"{variant}: {', '.join(names)}: {why}" for why, names in reasons.items()]
    return lines


def _compute_table(analysis: Analysis) -> pd.DataFrame:
    rows = []
    level = analysis.options.level
    for variant, boot in analysis.compute_fits.items():
        rows.append(
            {
                "variant": variant,
                "frontier points": boot.point.n_points,
                "E (nats)": format_interval(boot.estimate("E", level)),
                "A": format_interval(boot.estimate("A", level)),
                "a": format_interval(boot.estimate("a", level)),
            }
        )
    return pd.DataFrame(rows)


def _optimal_table(analysis: Analysis) -> pd.DataFrame:
    rows = []
    most = analysis.points["flops"].max()
    for variant, boot in analysis.fits.items():
        fit = boot.point
        if not fit.size_term_identified:
            continue  # the allocation rests on A and alpha (see the fits' notes)
        a_exp, b_exp = fit.exponents
        for budget in compute_budgets(analysis.points):
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
                    "": "beyond the runs" if budget > most else "within the runs",
                }
            )
    return pd.DataFrame(rows)


def multiplier_cell(row) -> str:
    """``1.10× [1.05×, 1.15×]``, or "not identified by these runs"."""
    if not row["identified"]:
        return NOT_IDENTIFIED
    if math.isnan(row["low"]):
        return _times(row["multiplier"])
    return f"{_times(row['multiplier'])} [{_times(row['low'])}, {_times(row['high'])}]"


def _multiplier_table(analysis: Analysis) -> pd.DataFrame:
    rows = []
    for variant, frame in analysis.multipliers.items():
        for _, row in frame.iterrows():
            rows.append(
                {
                    "variant": variant,
                    "N (params)": humanize_count(row["params"]),
                    "D (tokens)": humanize_count(row["tokens"]),
                    f"multiplier [{analysis.options.level:.0%} interval]": multiplier_cell(row),
                    "read at": row["read at"],
                }
            )
    return pd.DataFrame(rows)


def multiplier_definition(options: Options) -> str:
    """What the multiplier table holds, the same words under ``fit`` and ``report``."""
    extra = (
        f"; rows read at D = {options.tokens_per_param:g}·N come from the fits alone, "
        "beyond the runs' budgets or sizes"
        if options.multiplier_at == "per_param"
        else ""
    )
    return (
        f"Tokens {options.baseline} attention needs to reach the variant's loss, over the "
        "variant's tokens, from the two L(N, D) fits (∞: it never reaches it at that "
        "size; above 1: the variant needs fewer tokens). At the measured sizes it is read "
        f"at the size's N ({options.baseline}'s parameter count) and its runs' training "
        f"tokens D{extra}. The interval pairs bootstrap replicates of both fits and is "
        "centred on the multiplier (in factors)."
    )


def crossover_words(cross: compare.Crossover, options: Options) -> str:
    """Where the challenger overtakes, its interval, and the replicates that cross."""
    if not cross.identified:
        return f"{NOT_IDENTIFIED} ({cross.reason})"
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
    return (
        f"{where} (D = {options.tokens_per_param:g}·N); {options.level:.0%} interval "
        f"{interval}; {cross.fraction_crossing:.0%} of {cross.replicates} bootstrap "
        "replicates cross"
    )


def _relative(path: Path, folder: Path) -> str:
    return os.path.relpath(path, folder).replace(os.sep, "/")


def _gains_section(analysis: Analysis) -> list[str]:
    """Final perplexity against the baseline per size, with the step-time ratio from
    process CPU time (or flagged, with the reason)."""
    o = analysis.options
    gains = analysis.gains
    shown = pd.DataFrame(
        {
            "size": gains["size"],
            "variant": gains["variant"],
            "final val. ppl": gains["value"].map("{:.2f}".format),
            f"vs {o.baseline}": gains["percent"].map("{:+.1f}%".format),
            "seeds": gains["n"],
            "CPU s/step": gains["cpu_s_per_step"].map(
                lambda v: f"{v:.3f}" if pd.notna(v) else "n/a"
            ),
            f"step time / {o.baseline}": [
                format_ratio(r, c, bool(st))
                for r, c, st in zip(gains["ratio"], gains["clock"], gains["steady"], strict=True)
            ],
        }
    )
    lines = [
        f"## Perplexity and step time against {o.baseline} attention, per size",
        "",
        markdown_table(shown),
        "",
    ]
    clocks = set(gains["clock"].dropna()) - {""}
    if clocks == {CPU_CLOCK}:
        lines.append(
            f"Step time / {o.baseline}: the ratio of the runs' CPU seconds per step (process "
            "CPU time counts this process's work only, so other work on a shared machine "
            "moves it far less than wall clock, though shared caches and cores still do), "
            "checked on each half of the steps; for speed claims use `cqk bench --clock "
            "cpu`, which interleaves the variants."
        )
    # One line per flagged cell, naming its variant and size: the same variant can be
    # steady at one size and not at another.
    flagged = gains[gains["note"].fillna("") != ""]
    lines += [f"- {r.variant} at {r.size}: {r.note}" for r in flagged.itertuples()]
    if (gains["n"] <= 1).all():
        lines.append(
            "\n_One seed per size: the spread between seeds is not measured, so no "
            "perplexity gap in this table can be told from seed noise._"
        )
    return [*lines, ""]


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def interpretation(analysis: Analysis) -> str:
    """One paragraph, in plain words, on what the fits support with these runs."""
    o, runs, points = analysis.options, analysis.runs, analysis.points
    if runs.empty or points.empty:
        return "_No runs with validation points: nothing to interpret._"
    sizes = runs.groupby("size")[o.n_column].min().sort_values()
    seeds = int(runs.groupby(["size", "variant"])["seed"].nunique().max())
    runs_per_fit = int(runs.groupby("variant")["run"].nunique().min())
    parts = [_what_the_fits_rest_on(analysis, sizes, seeds), *_alpha_interval(analysis)]
    if runs_per_fit < 6:
        # distinct multisets of n runs drawn with replacement from n: C(2n - 1, n)
        distinct = math.comb(2 * runs_per_fit - 1, runs_per_fit)
        parts.append(
            f"With {runs_per_fit} runs per fit the bootstrap can only redraw those runs "
            f"({distinct} distinct resamples), so its intervals are coarse, not calibrated."
        )
    parts += _multiplier_verdicts(analysis, seeds, runs_per_fit)
    parts += _caveats(analysis, sizes)
    return " ".join(parts)


def _what_the_fits_rest_on(analysis: Analysis, sizes: pd.Series, seeds: int) -> str:
    o, runs = analysis.options, analysis.runs
    tokens = runs["tokens"]
    per_param = tokens / runs[o.n_column]
    return (
        f"These fits rest on {_plural(len(sizes), 'model size')}, "
        f"{humanize_count(sizes.iloc[0])} to {humanize_count(sizes.iloc[-1])} "
        f"{'non-embedding ' if o.n_column == 'params_non_embedding' else ''}parameters, "
        f"{_plural(seeds, 'seed')} per size and variant, and {humanize_count(tokens.min())}"
        f"{'' if tokens.min() == tokens.max() else ' to ' + humanize_count(tokens.max())} "
        f"training tokens per run ({per_param.min():.2g} to {per_param.max():.2g} tokens per "
        "parameter; Chinchilla-optimal is about 20)."
    )


def _alpha_interval(analysis: Analysis) -> list[str]:
    """The first variant with a bootstrap interval on α says how well it is pinned down
    (the table has the others)."""
    o, runs = analysis.options, analysis.runs
    for variant, boot in analysis.fits.items():
        found = boot.estimate("alpha", o.level)
        if not found.identified:
            return [f"For {variant}, the size exponent α is {NOT_IDENTIFIED} ({found.reason})."]
        low, high = found.low, found.high
        if math.isnan(low):
            continue
        return [
            f"For {variant}, five constants come from {boot.point.n_points} points of "
            f"{runs[runs['variant'] == variant]['run'].nunique()} runs, and the bootstrap "
            f"puts the size exponent α between {low:.2f} and {high:.2f}"
            + (
                ": the data do not pin it down."
                if high - low > 0.5 * max(abs(boot.point.alpha), 0.1)
                else "."
            )
        ]
    return []


def _multiplier_verdicts(analysis: Analysis, seeds: int, runs_per_fit: int) -> list[str]:
    """Per variant: whether its multiplier's interval excludes 1 at a measured size."""
    o = analysis.options
    few = seeds == 1 or runs_per_fit < 6
    parts = []
    for variant, frame in analysis.multipliers.items():
        measured = frame[~frame["extrapolated"]]
        if measured[["low", "high"]].isna().any().any():
            parts.append(f"The {variant} multiplier has no bootstrap interval.")
            continue
        if not measured["identified"].any():
            parts.append(f"The {variant} multiplier is {NOT_IDENTIFIED} at any measured size.")
            continue
        measured = measured[measured["identified"]]
        outside = measured[(measured["low"] > 1) | (measured["high"] < 1)]
        if outside.empty:
            parts.append(
                f"The {variant} multiplier's {o.level:.0%} interval includes 1 at every "
                f"measured size: these runs cannot tell {variant} from {o.baseline} "
                "attention in data efficiency."
            )
            continue
        where = ", ".join(
            f"{humanize_count(r['params'])} ({_times(r['low'])} – {_times(r['high'])})"
            for _, r in outside.iterrows()
        )
        parts.append(
            f"The {variant} multiplier's {o.level:.0%} interval excludes 1 at {where}"
            + (
                f"; with {_plural(seeds, 'seed')} per size and {runs_per_fit} runs per fit "
                "that is a pattern to check with more seeds, not evidence of a difference."
                if few
                else ", a difference these runs can see."
            )
        )
    return parts


def _caveats(analysis: Analysis, sizes: pd.Series) -> list[str]:
    """What the D axis, the embedding share and the measured sizes leave out."""
    runs, parts = analysis.runs, []
    if analysis.options.points == "all":
        parts.append(
            "The D axis comes from evaluations during each run: before the end of a cosine "
            "schedule the loss sits above that of a run trained for that many tokens, which "
            "bends the fitted token exponent β."
        )
    embedding_share = 1 - float((runs["params_non_embedding"] / runs["params_total"]).median())
    if embedding_share > 0.5:
        parts.append(
            f"The embedding and output layer hold {embedding_share:.0%} of the parameters "
            "and much of the compute, which N leaves out."
        )
    if sizes.iloc[-1] < 1e7:
        parts.append(
            "Exponents measured below 10M parameters do not carry to the 60M-7B ladder: "
            "read these fits as a check that the path from runs to scaling laws works, "
            "not as a measurement of coupled attention."
        )
    else:
        parts.append(
            "Extrapolating beyond the measured sizes or budgets is the fits' assumption, "
            "not their evidence."
        )
    return parts


RUN_COLUMNS = [
    "run",
    "variant",
    "size",
    "seed",
    "params_non_embedding",
    "tokens",
    "steps",
    "final_val_loss",
    "final_val_ppl",
    "cpu_s_per_step",
    "tokens_per_s",
    "finished",
]
RUN_HEADINGS = {
    "params_non_embedding": "non-emb params",
    "cpu_s_per_step": "CPU s/step",
    "tokens_per_s": "tokens/s (wall)",
}
RUN_FORMATS = {
    "non-emb params": _count,
    "tokens": _count,
    "final_val_loss": lambda v: f"{v:.4f}" if pd.notna(v) else "",
    "final_val_ppl": lambda v: f"{v:.2f}" if pd.notna(v) else "",
    "CPU s/step": lambda v: f"{v:.3f}" if pd.notna(v) else "n/a",
    "tokens/s (wall)": lambda v: f"{v:,.0f}" if pd.notna(v) else "",
}


def render_markdown(analysis: Analysis, figures: dict[str, Path], folder: Path) -> str:
    """The report: runs, gains, curves, the fits, the multiplier, crossovers, seed
    variance, what it all can mean, and what was skipped (one section each)."""
    out = _runs_section(analysis)
    if analysis.gains is not None:
        out += _gains_section(analysis)
    out += ["## Loss curves", "", f"![loss curves]({_relative(figures['curves'], folder)})", ""]
    out += _fit_sections(analysis, figures, folder)
    out += _multiplier_section(analysis, figures, folder)
    out += _crossover_section(analysis)
    out += _seed_variance_section(analysis)
    out += ["## What these fits can and cannot mean", "", interpretation(analysis), ""]
    out += _problems_section(analysis)
    return "\n".join(out)


def _runs_section(analysis: Analysis) -> list[str]:
    o, ingested, runs = analysis.options, analysis.ingested, analysis.runs
    partial = int((~runs["finished"]).sum()) if not runs.empty else 0
    n_name = "non-embedding" if o.n_column == "params_non_embedding" else "total"
    return [
        "# Scaling analysis",
        "",
        f"{len(runs)} runs ({partial} partial), {len(ingested.skipped)} skipped. "
        f"Fits use {FIT_POINTS[o.points]}; "
        f"N counts {n_name} parameters, D tokens, losses are in nats per token. "
        f"Intervals: {INTERVAL_WORDS.format(level=o.level, n_boot=o.n_boot)}",
        "",
        "## Runs",
        "",
        markdown_table(runs[RUN_COLUMNS].rename(columns=RUN_HEADINGS), RUN_FORMATS),
        "",
        "CPU s/step: the training process's CPU time per step (median over steps, rank 0). "
        "tokens/s (wall) is wall clock: it moves with whatever else the machine runs, so it "
        "says how long this took, not how fast a variant is.",
        "",
    ]


INTERVAL_WORDS = (
    "{level:.0%}, from {n_boot} bootstrap resamples of runs, centred on the point "
    "estimate (the point plus or minus the {level:.0%} quantile of the replicates' distance "
    "from it, in factors for positive constants and multipliers), so each contains its "
    "point. A value whose interval spans more than a decade, or that the fit's model sizes "
    f'cannot fix, is printed as "{NOT_IDENTIFIED}" instead of a number.'
)


def _fit_sections(analysis: Analysis, figures: dict[str, Path], folder: Path) -> list[str]:
    """L(N, D), L(C) and the compute-optimal allocation, with their figures."""
    out = ["## Scaling-law fits: L(N, D) = E + A/N^α + B/D^β", ""]
    if analysis.fits:
        out += [markdown_table(_fits_table(analysis)), ""]
        notes = unidentified_notes(analysis)
        out += [*(f"- {line}" for line in notes), *([""] if notes else [])]
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
        optimal = _optimal_table(analysis)
        table = markdown_table(optimal) if not optimal.empty else f"_{ALLOCATION_UNIDENTIFIED}._"
        out += ["## Compute-optimal allocation (C = 6·N·D)", "", table, ""]
    return out


ALLOCATION_UNIDENTIFIED = (
    f"{NOT_IDENTIFIED}: the allocation rests on A and α, which the fits' model sizes do "
    "not fix (see the notes under the fits)"
)


def _multiplier_section(analysis: Analysis, figures: dict[str, Path], folder: Path) -> list[str]:
    if not analysis.multipliers:
        return []
    o = analysis.options
    out = [
        f"## Data-efficiency multiplier over {o.baseline} attention",
        "",
        multiplier_definition(o),
        "",
        markdown_table(_multiplier_table(analysis)),
        "",
    ]
    if "multiplier" in figures:
        out += [f"![multiplier]({_relative(figures['multiplier'], folder)})", ""]
    return out


def _crossover_section(analysis: Analysis) -> list[str]:
    if not analysis.crossovers:
        return []
    o, out = analysis.options, ["## Crossover", ""]
    for (challenger, incumbent), cross in analysis.crossovers.items():
        out.append(
            f"- where **{challenger}** overtakes **{incumbent}**: {crossover_words(cross, o)}."
        )
    return [*out, ""]


SEED_COLUMNS = [
    "size",
    "variant",
    "seeds",
    "mean_loss",
    "std_loss",
    "mean_ppl",
    "ppl_range",
    "variance_ratio",
]
SEED_FORMATS = {
    "std_loss": "{:.4f}".format,
    "mean_loss": "{:.4f}".format,
    "mean_ppl": "{:.2f}".format,
    "ppl_range": "{:.2f}".format,
}


def _seed_variance_section(analysis: Analysis) -> list[str]:
    if analysis.seed_variance is None or not (analysis.seed_variance["seeds"] > 1).any():
        return []
    sv = analysis.seed_variance[analysis.seed_variance["seeds"] > 1]
    heading = {"variance_ratio": f"var / {analysis.options.baseline} var"}
    return [
        "## Seed variance",
        "",
        markdown_table(sv[SEED_COLUMNS].rename(columns=heading), SEED_FORMATS),
        "",
    ]


def _problems_section(analysis: Analysis) -> list[str]:
    ingested = analysis.ingested
    problems = [f"- skipped `{s.path}`: {s.reason}" for s in ingested.skipped]
    problems += [f"- {w}" for w in ingested.warnings] + [f"- {n}" for n in analysis.notes]
    if not problems:
        return []
    return ["## Skipped runs, warnings and notes", "", *problems, ""]


# ---------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------


def fits_json(analysis: Analysis) -> dict:
    level = analysis.options.level
    return {
        "chinchilla": {
            v: {
                **b.point.params(),
                "sizes": b.point.n_sizes,
                "intervals": {p: b.estimate(p, level).as_dict() for p in PARAMS},
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
            analysis.options.baseline,
        )
    with atomic_path(folder / "runs.csv") as temporary:
        table.to_csv(temporary, index=False)
    write_text_atomically(
        folder / "fits.json", json.dumps(fits_json(analysis), indent=2, default=_jsonable)
    )
    report = folder / "report.md"
    write_text_atomically(report, render_markdown(analysis, figures, folder))
    return report


def _jsonable(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, np.bool_):
        return bool(value)
    return str(value)


def gains_report(points: pd.DataFrame, baseline: str, crossovers) -> str:
    """Markdown: % change against the baseline per size, and the crossovers, from points
    (``cqk analyze gains``)."""
    table = compare.percent_change_table(points, baseline, metric="ppl")
    table["range"] = [
        f"{low:.2f}-{high:.2f}" if high > low else ""
        for low, high in zip(table["low"], table["high"], strict=True)
    ]
    view = table[["size", "variant", "value", "range", "percent"]].rename(
        columns={"value": "ppl", "percent": f"vs {baseline}"}
    )
    lines = [markdown_table(view, {"ppl": "{:.2f}".format, f"vs {baseline}": "{:+.1f}%".format})]
    for challenger, incumbent in crossovers:
        size = compare.crossover_from_points(points, challenger, incumbent)
        where = f"at about {humanize_count(size)} parameters" if size else "not within the sizes"
        lines.append(f"\n{challenger} overtakes {incumbent} {where} (log-linear interpolation).")
    return "\n".join(lines)
