"""``cqk-analyze``: scaling-law analysis over run folders.

    cqk-analyze table  RUNS... [--csv runs.csv]          # one row per run (+ tidy CSV)
    cqk-analyze fit    RUNS... [--points all|final]      # fits, multipliers, crossover
    cqk-analyze report RUNS... --out reports/ladder      # report.md + figures/*.png
    cqk-analyze gains  points.csv                        # % vs standard from a CSV
    cqk-analyze ladder configs/sweeps/ladder.yaml        # the runs a sweep expands to

RUNS are folders searched recursively for run folders (``metrics.jsonl`` + ``config.yaml``)
and wandb offline runs; ``--wandb-project entity/project`` adds runs from the wandb API
(needs WANDB_API_KEY and network).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from cqk_megatron.analysis import compare
from cqk_megatron.analysis.ingest import humanize_count, ingest
from cqk_megatron.run.atomic import atomic_path


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="folders holding run folders")
    parser.add_argument("--wandb-project", default=None, help="also read entity/project via API")


def _add_fit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--points", choices=("all", "final"), default="all")
    parser.add_argument("--params", choices=("non_embedding", "total"), default="non_embedding")
    parser.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples")
    parser.add_argument("--level", type=float, default=0.95, help="interval level")
    parser.add_argument("--tokens-per-param", type=float, default=compare.TOKENS_PER_PARAM)
    parser.add_argument(
        "--multiplier-at",
        choices=("per-param", "measured"),
        default="per-param",
        help="read the data-efficiency multiplier at D = tokens-per-param x N (and ladder "
        "sizes beyond the runs), or at each measured size's own training budget",
    )
    parser.add_argument("--baseline", default="standard")
    parser.add_argument(
        "--crossover",
        action="append",
        default=None,
        metavar="CHALLENGER:INCUMBENT",
        help="size where CHALLENGER overtakes INCUMBENT (default differential:coupled)",
    )


def _options(args):
    from cqk_megatron.analysis.report import DEFAULT_CROSSOVERS, Options

    crossovers = DEFAULT_CROSSOVERS
    if args.crossover:
        crossovers = tuple(tuple(c.split(":")) for c in args.crossover)
        if not all(len(c) == 2 for c in crossovers):
            raise SystemExit("--crossover takes CHALLENGER:INCUMBENT, e.g. differential:coupled")
    return Options(
        points=args.points,
        n_column=f"params_{args.params}",
        n_boot=args.bootstrap,
        level=args.level,
        tokens_per_param=args.tokens_per_param,
        multiplier_at=args.multiplier_at.replace("-", "_"),
        baseline=args.baseline,
        crossovers=crossovers,
    )


def _ingest(args):
    ingested = ingest(args.runs, wandb_project=args.wandb_project)
    for skipped in ingested.skipped:
        print(f"skipped {skipped.path}: {skipped.reason}", file=sys.stderr)
    for warning in ingested.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if ingested.table.empty:
        raise SystemExit(f"no usable runs under {' '.join(args.runs)}")
    return ingested


def _print_runs(runs: pd.DataFrame) -> None:
    view = runs.copy()
    for column in ("params_total", "params_non_embedding", "tokens"):
        view[column] = view[column].map(humanize_count)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(view.to_string(index=False, float_format=lambda v: f"{v:.4g}"))


def cmd_table(args) -> None:
    ingested = _ingest(args)
    _print_runs(ingested.runs)
    if args.csv:
        path = Path(args.csv)
        with atomic_path(path) as temporary:
            ingested.table.to_csv(temporary, index=False)
        print(f"wrote the tidy table ({len(ingested.table)} rows) to {path}")


def cmd_fit(args) -> None:
    from cqk_megatron.analysis.report import (
        _compute_table,
        _fits_table,
        _multiplier_table,
        analyze,
        markdown_table,
    )

    analysis = analyze(_ingest(args), _options(args))
    print("L(N, D) fits:\n" + markdown_table(_fits_table(analysis)))
    print("\nL(C) fits:\n" + markdown_table(_compute_table(analysis)))
    if analysis.multipliers:
        print("\nData-efficiency multipliers:\n" + markdown_table(_multiplier_table(analysis)))
    for (challenger, incumbent), cross in analysis.crossovers.items():
        size = humanize_count(cross.size) if cross.size else "none in range"
        print(
            f"\n{challenger} overtakes {incumbent} at N = {size} "
            f"(interval {humanize_count(cross.low) if cross.low == cross.low else 'n/a'}"
            f" - {humanize_count(cross.high) if cross.high == cross.high else 'n/a'}, "
            f"{cross.fraction_crossing:.0%} of replicates cross)"
        )
    for note in analysis.notes:
        print(f"note: {note}")


def cmd_report(args) -> None:
    from cqk_megatron.analysis.report import analyze, write_report

    analysis = analyze(_ingest(args), _options(args))
    path = write_report(analysis, args.out)
    print(f"wrote {path} (figures in {path.parent / 'figures'})")


def gains_report(points: pd.DataFrame, baseline: str, crossovers) -> str:
    """Markdown: % change against the baseline per size, and the crossovers, from points."""
    from cqk_megatron.analysis.report import markdown_table

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


def cmd_gains(args) -> None:
    points = pd.read_csv(args.csv)
    missing = {"size", "params", "variant", "ppl"} - set(points.columns)
    if missing:
        raise SystemExit(
            f"{args.csv}: missing columns {sorted(missing)} (need size,params,variant,ppl)"
        )
    crossovers = args.crossover or ["differential:coupled"]
    print(gains_report(points, args.baseline, [tuple(c.split(":")) for c in crossovers]))


def cmd_ladder(args) -> None:
    from cqk_megatron.planner.sweep import expand_sweep

    runs = expand_sweep(args.sweep)
    for run in runs:
        r = run["resources"]
        print(
            f"{run['name']:<40} {r['nodes']} x {r['gpus_per_node']} GPUs  "
            f"{' '.join(run['overrides'][1:])}"
        )
    print(f"{len(runs)} runs")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="cqk-analyze",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    commands = parser.add_subparsers(dest="command", required=True)

    table = commands.add_parser("table", help="one row per run; optionally the tidy CSV")
    _add_run_arguments(table)
    table.add_argument("--csv", default=None, help="write the tidy per-step table here")
    table.set_defaults(func=cmd_table)

    fit = commands.add_parser("fit", help="print fits, multipliers and crossovers")
    _add_run_arguments(fit)
    _add_fit_arguments(fit)
    fit.set_defaults(func=cmd_fit)

    report = commands.add_parser("report", help="write report.md with figures")
    _add_run_arguments(report)
    _add_fit_arguments(report)
    report.add_argument("--out", required=True, help="output folder")
    report.set_defaults(func=cmd_report)

    gains = commands.add_parser("gains", help="%% change vs baseline from a CSV of perplexities")
    gains.add_argument("csv", help="columns size,params,variant,ppl[,ppl_low,ppl_high]")
    gains.add_argument("--baseline", default="standard")
    gains.add_argument(
        "--crossover", action="append", default=None, help="CHALLENGER:INCUMBENT, repeatable"
    )
    gains.set_defaults(func=cmd_gains)

    ladder = commands.add_parser("ladder", help="list the runs a sweep file expands to")
    ladder.add_argument("sweep", help="e.g. configs/sweeps/ladder.yaml")
    ladder.set_defaults(func=cmd_ladder)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
