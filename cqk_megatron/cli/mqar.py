"""``cqk mqar``: multi-query associative recall (MQAR), how fast each
attention variant learns to recall.

    cqk mqar --variants standard,coupled --settings 64x4,128x8 --seeds 0,1,2
    cqk mqar --benchmark --out runs/mqar_benchmark      # the results page's table and plot
    cqk mqar gap --help                                 # the gap study
    cqk mqar probe --help                               # one benchmark run with one change

Each run trains a small model on fresh batches and evaluates held-out accuracy every
``--eval-every`` steps; per variant, family, coupling position and setting the table gives,
over the seeds, the training examples needed to reach 0.5 and 0.9 accuracy, the final
accuracy and how many seeds solved the setting. ``OUT/runs.jsonl`` keeps every finished
run: the same command again skips them. ``cqk_megatron.eval.mqar`` has the details.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import MISSING, fields
from pathlib import Path

from cqk_megatron.cli.args import add_out, new_parser
from cqk_megatron.config import MODEL_FAMILIES, VARIANTS
from cqk_megatron.eval.mqar_options import (
    DEFAULT_SETTINGS,
    HARDER_SETTINGS,
    POSITIONS,
    REINIT_PARTS,
    TrainOptions,
)

# fields the grid sets per run, or that take structured values: no flag of their own
NOT_FLAGS = ("family", "position", "seed", "megatron", "plain")


def add_train_options(parser: argparse.ArgumentParser) -> None:
    """One flag per ``TrainOptions`` field, with the field's help; unset flags (None) keep
    the field's default, or the benchmark's with ``--benchmark``."""
    group = parser.add_argument_group("run options (TrainOptions; default: the field's)")
    for f in fields(TrainOptions):
        if f.name in NOT_FLAGS:
            continue
        flag = f"--{f.name.replace('_', '-')}"
        default = None if f.default is MISSING else f.default
        help = f.metadata["help"]
        if default is not None and "default" not in help:
            help += f" (default: {default})"
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help)
        elif f.name == "reinit":
            group.add_argument(flag, choices=REINIT_PARTS, help=help)
        elif default is None or f.name == "stop_at":
            kind = float if f.name in ("stop_at", "init_std") else int
            group.add_argument(flag, type=kind, help=help)
        else:
            group.add_argument(flag, type=type(default), help=help)


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("cqk mqar", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument(
        "--variants", default="standard,coupled,differential", help="comma-separated variants"
    )
    parser.add_argument(
        "--settings",
        default=",".join(DEFAULT_SETTINGS),
        help=f"SEQ_LENxNUM_KV_PAIRS list; harder ones: {','.join(HARDER_SETTINGS)}",
    )
    parser.add_argument(
        "--seeds", default=None, help="comma-separated seeds (default: 0; --benchmark: 0,1,2)"
    )
    parser.add_argument("--families", default="llama", help=f"from {list(MODEL_FAMILIES)}")
    parser.add_argument(
        "--positions", default="pre_rope", help=f"coupling positions, from {list(POSITIONS)}"
    )
    parser.add_argument(
        "--benchmark",
        action="store_true",
        help="the results page's benchmark (eval.mqar.BENCHMARK): every variant on 64x4, four "
        "on 128x8, standard and coupled on 128x16 and in both families and coupling "
        "positions, 3 seeds",
    )
    add_train_options(parser)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: every core)"
    )
    parser.add_argument(
        "--shard",
        default=None,
        help="K/N: train only every N-th requested run from the K-th (0-based), so N processes "
        "can share one --out; the same command without --shard then writes the table",
    )
    add_out(
        parser,
        "folder for runs.jsonl, the results, the table and the plot (default: print only)",
        old=("--out-dir",),
        default=None,
    )
    return parser


def csv(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def requested_runs(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The options and the runs the command line asks for (``parser.error`` on bad ones)."""
    from cqk_megatron.eval.mqar import BENCHMARK, benchmark_runs, grid
    from cqk_megatron.eval.mqar_data import MQARSetting

    names = [f.name for f in fields(TrainOptions)]
    given = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    if args.benchmark:
        options = TrainOptions(**{**BENCHMARK["options"], **given})
        seeds = [int(s) for s in csv(args.seeds)] if args.seeds else BENCHMARK["seeds"]
        requested = benchmark_runs(seeds)
    else:
        options = TrainOptions(**given)
        variants, families = csv(args.variants), csv(args.families)
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown:
            parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
        bad = [f for f in families if f not in MODEL_FAMILIES]
        if bad:
            parser.error(f"unknown families {bad}; choose from {list(MODEL_FAMILIES)}")
        positions = csv(args.positions)
        if any(p not in POSITIONS for p in positions):
            parser.error(f"--positions takes {list(POSITIONS)}")
        seeds = [int(s) for s in csv(args.seeds or "0")]
        requested = grid(variants, csv(args.settings), seeds, families, positions)
    try:
        options.check()
        for label in dict.fromkeys(p["setting"] for p in requested):
            MQARSetting.parse(label).check(options.vocab_size)
    except ValueError as error:
        parser.error(str(error))
    return options, requested


def shard_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in args.shard.split("/"))
    except ValueError:
        index = count = -1
    if not 0 <= index < count:
        parser.error(f"--shard {args.shard!r} must be K/N with 0 <= K < N, e.g. 0/2")
    if args.out is None:
        parser.error("--shard needs --out (the shards share its runs.jsonl)")
    return index, count


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options, requested = requested_runs(args, parser)
    shard = shard_of(args, parser) if args.shard else None

    import os
    from dataclasses import asdict

    import torch

    from cqk_megatron.eval.mqar import (
        _gather_shards,
        format_table,
        run_grid,
        summarize,
        write_results,
    )

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    out = Path(args.out) if args.out else None
    print(f"MQAR: {len(requested)} runs; options {asdict(options)}", flush=True)
    started = time.perf_counter()
    if shard is not None:  # this process's share only: the table needs every run
        index, count = shard
        share = requested[index::count]
        run_grid(share, options, out / f"runs.shard{index}.jsonl")
        wall = time.perf_counter() - started
        print(f"shard {args.shard}: {len(share)} runs, wall time {wall:.0f} s")
        return 0
    if out is not None:
        _gather_shards(out)
    runs = run_grid(requested, options, out / "runs.jsonl" if out else None)
    wall = time.perf_counter() - started
    rows = summarize(runs)
    chance = runs[0]["chance"] if runs else float("nan")
    print(f"\nMQAR held-out accuracy (chance {chance:.4f}), {len(runs)} runs:")
    print(format_table(rows))
    if out:
        write_results(out, options, runs, rows, wall)
        print(f"wrote {out / 'mqar_results.json'}, mqar_results.md and mqar_curves.png")
    print(f"wall time {wall:.0f} s")
    return 0
