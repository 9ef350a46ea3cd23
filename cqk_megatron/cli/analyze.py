"""``cqk analyze``: scaling-law analysis over run folders.

    cqk analyze table  RUNS... [--csv runs.csv]          # one row per run (+ tidy CSV)
    cqk analyze fit    RUNS... [--points all|final]      # fits, multipliers, crossover
    cqk analyze report RUNS... --out reports/ladder      # report.md + figures/*.png
    cqk analyze gains  points.csv                        # % vs standard from a CSV
    cqk analyze ladder configs/sweeps/ladder.yaml        # the runs a sweep expands to

RUNS are folders searched recursively for run folders (``metrics.jsonl`` + ``config.yaml``)
and wandb offline runs; ``--wandb-project entity/project`` adds runs from the wandb API
(needs WANDB_API_KEY and network). The analysis itself (pandas, scipy, matplotlib) loads
when a subcommand runs, not for ``--help``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cqk_megatron.cli.args import HelpFormatter, new_parser

# Chinchilla's compute-optimal ratio, the ladder's budget: ``analysis.compare``'s
# TOKENS_PER_PARAM, written here because compare imports pandas (tests/test_cli_help.py
# checks that the two agree).
TOKENS_PER_PARAM = 20.0


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="folders holding run folders")
    parser.add_argument(
        "--wandb-project", default=None, help="also read the runs of entity/project via the API"
    )


def add_fit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--points",
        choices=("all", "final"),
        default="all",
        help="fit every evaluation of each run, or only its final one",
    )
    parser.add_argument(
        "--params",
        choices=("non_embedding", "total"),
        default="non_embedding",
        help="which parameter count is N",
    )
    parser.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples")
    parser.add_argument("--level", type=float, default=0.95, help="interval level")
    parser.add_argument(
        "--tokens-per-param",
        type=float,
        default=TOKENS_PER_PARAM,
        help="training tokens per parameter where the multiplier is read (per-param)",
    )
    parser.add_argument(
        "--multiplier-at",
        choices=("measured", "per-param"),
        default="measured",
        help="read the data-efficiency multiplier at each measured size's N and training "
        "tokens (always), or also at D = tokens-per-param x N, at the measured sizes and "
        "ladder sizes beyond (rows labelled as read from the fits)",
    )
    _add_comparison_arguments(parser)


def _add_comparison_arguments(parser: argparse.ArgumentParser) -> None:
    """The baseline and the crossovers, as ``fit``, ``report`` and ``gains`` take them."""
    parser.add_argument("--baseline", default="standard", help="the variant compared against")
    parser.add_argument(
        "--crossover",
        action="append",
        default=None,
        metavar="CHALLENGER:INCUMBENT",
        help="size where CHALLENGER overtakes INCUMBENT, repeatable (default: "
        "differential:coupled)",
    )


def options(args: argparse.Namespace):
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


def ingest_runs(args: argparse.Namespace):
    from cqk_megatron.analysis.ingest import ingest

    ingested = ingest(args.runs, wandb_project=args.wandb_project)
    for skipped in ingested.skipped:
        print(f"skipped {skipped.path}: {skipped.reason}", file=sys.stderr)
    for warning in ingested.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if ingested.table.empty:
        raise SystemExit(f"no usable runs under {' '.join(args.runs)}")
    return ingested


def print_runs(runs) -> None:
    import pandas as pd

    from cqk_megatron.analysis.ingest import humanize_count

    view = runs.copy()
    for column in ("params_total", "params_non_embedding", "tokens"):
        view[column] = view[column].map(humanize_count)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(view.to_string(index=False, float_format=lambda v: f"{v:.4g}"))


def cmd_table(args: argparse.Namespace) -> None:
    from cqk_megatron.run.atomic import atomic_path

    ingested = ingest_runs(args)
    print_runs(ingested.runs)
    if args.csv:
        path = Path(args.csv)
        with atomic_path(path) as temporary:
            ingested.table.to_csv(temporary, index=False)
        print(f"wrote the tidy table ({len(ingested.table)} rows) to {path}")


def cmd_fit(args: argparse.Namespace) -> None:
    from cqk_megatron.analysis.report import (
        INTERVAL_WORDS,
        _compute_table,
        _fits_table,
        _multiplier_table,
        analyze,
        crossover_words,
        markdown_table,
        multiplier_definition,
        unidentified_notes,
    )

    analysis = analyze(ingest_runs(args), options(args))
    o = analysis.options
    print("Intervals: " + INTERVAL_WORDS.format(level=o.level, n_boot=o.n_boot))
    print("\nL(N, D) fits:\n" + markdown_table(_fits_table(analysis)))
    for line in unidentified_notes(analysis):
        print(f"  {line}")
    print("\nL(C) fits:\n" + markdown_table(_compute_table(analysis)))
    if analysis.multipliers:
        print(f"\nData-efficiency multipliers: {multiplier_definition(o)}")
        print(markdown_table(_multiplier_table(analysis)))
    for (challenger, incumbent), cross in analysis.crossovers.items():
        print(f"\nwhere {challenger} overtakes {incumbent}: {crossover_words(cross, o)}")
    for note in analysis.notes:
        print(f"note: {note}")


def cmd_report(args: argparse.Namespace) -> None:
    from cqk_megatron.analysis.report import analyze, write_report

    analysis = analyze(ingest_runs(args), options(args))
    path = write_report(analysis, args.out)
    print(f"wrote {path} (figures in {path.parent / 'figures'})")


def cmd_gains(args: argparse.Namespace) -> None:
    import pandas as pd

    from cqk_megatron.analysis.report import gains_report

    points = pd.read_csv(args.csv)
    missing = {"size", "params", "variant", "ppl"} - set(points.columns)
    if missing:
        raise SystemExit(
            f"{args.csv}: missing columns {sorted(missing)} (need size,params,variant,ppl)"
        )
    crossovers = args.crossover or ["differential:coupled"]
    print(gains_report(points, args.baseline, [tuple(c.split(":")) for c in crossovers]))


def cmd_ladder(args: argparse.Namespace) -> None:
    from cqk_megatron.planner.sweep import expand_sweep

    runs = expand_sweep(args.sweep)
    for run in runs:
        r = run["resources"]
        print(
            f"{run['name']:<40} {r['nodes']} x {r['gpus_per_node']} GPUs  "
            f"{' '.join(run['overrides'][1:])}"
        )
    print(f"{len(runs)} runs")


def add_subcommand(commands: argparse._SubParsersAction, name: str, help: str, func):
    parser = commands.add_parser(
        name, help=help, description=help.replace("%%", "%"), formatter_class=HelpFormatter
    )
    parser.set_defaults(func=func)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("cqk analyze", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    commands = parser.add_subparsers(dest="command", required=True, help="what to do")
    table = add_subcommand(commands, "table", "one row per run; optionally the tidy CSV", cmd_table)
    add_run_arguments(table)
    table.add_argument("--csv", default=None, help="write the tidy per-step table here")
    fit = add_subcommand(commands, "fit", "print fits, multipliers and crossovers", cmd_fit)
    add_run_arguments(fit)
    add_fit_arguments(fit)
    report = add_subcommand(commands, "report", "write report.md with figures", cmd_report)
    add_run_arguments(report)
    add_fit_arguments(report)
    report.add_argument("--out", required=True, help="output folder")
    gains = add_subcommand(
        commands, "gains", "%% change vs baseline from a CSV of perplexities", cmd_gains
    )
    gains.add_argument("csv", help="columns size,params,variant,ppl[,ppl_low,ppl_high]")
    _add_comparison_arguments(gains)
    ladder = add_subcommand(commands, "ladder", "list the runs a sweep file expands to", cmd_ladder)
    ladder.add_argument("sweep", help="sweep YAML, e.g. configs/sweeps/ladder.yaml")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0
