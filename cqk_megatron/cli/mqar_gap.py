"""``cqk mqar gap``: why the project's coupled
model fell behind on MQAR where an independent one pulled ahead, one difference at a time
between the two setups (``cqk_megatron.eval.mqar_gap`` has the rungs).

    cqk mqar gap --rungs project,independent --seeds 0,1,2 --out runs/mqar_gap/runs.jsonl
    cqk mqar gap --report runs/mqar_gap/runs.jsonl

Both setups train on 128x8 (vocabulary 512, width 64, one head of 64, two layers) for
2,500 steps of 128 sequences, evaluating 512 held-out sequences every 100 steps; each run
is appended to ``--out`` as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from cqk_megatron.cli.args import new_parser


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "cqk mqar gap", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1]
    )
    parser.add_argument(
        "--rungs",
        default="project,independent",
        help="comma-separated rungs of eval/mqar_gap.py's RUNGS (an unknown name lists them)",
    )
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated variants (default: the study's, standard and coupled)",
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=None, help="override the 2,500 steps")
    parser.add_argument(
        "--stop-after", type=int, default=None, help="stop there (the schedule keeps --steps)"
    )
    parser.add_argument(
        "--out", default="runs/mqar_gap/runs.jsonl", help="runs.jsonl to append each run to"
    )
    parser.add_argument("--report", default=None, help="print the table of a runs.jsonl")
    parser.add_argument("--report-out", default=None, help="also write the table here")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: all)")
    return parser


def print_report(args: argparse.Namespace) -> None:
    from cqk_megatron.eval.mqar_gap import report
    from cqk_megatron.run.atomic import write_text_atomically

    lines = Path(args.report).read_text().splitlines()
    table = report([json.loads(line) for line in lines if line.strip()])
    print(table)
    if args.report_out:
        write_text_atomically(Path(args.report_out), table + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.report:
        print_report(args)
        return 0

    import torch

    from cqk_megatron.eval.mqar_gap import RUNGS, VARIANTS, run

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    rungs = [r for r in args.rungs.split(",") if r]
    unknown = [r for r in rungs if r not in RUNGS]
    if unknown:
        parser.error(f"unknown rungs {unknown}; choose from {list(RUNGS)}")
    overrides = {"steps": args.steps} if args.steps else {}
    if args.stop_after:
        overrides["stop_after"] = args.stop_after
    variants = [v for v in (args.variants or ",".join(VARIANTS)).split(",") if v]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    run(rungs, variants, seeds, Path(args.out), **overrides)
    return 0
