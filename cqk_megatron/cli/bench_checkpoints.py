"""``cqk bench checkpoints``: how long a checkpoint save takes on this machine, part by
part, and what the asynchronous save would cost a cluster run.

A model of ``--layers`` transformer-sized blocks in bf16 with fp32 master weights and two
Adam moments is saved the way training saves it, in one process
(``cqk_megatron/bench/checkpoints.py`` says what each part measures).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cqk_megatron.cli.args import new_parser


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "cqk bench checkpoints", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1]
    )
    parser.add_argument("--hidden", type=int, default=768, help="the blocks' width")
    parser.add_argument("--layers", type=int, default=12, help="how many blocks")
    parser.add_argument("--vocab", type=int, default=32768, help="the embedding's rows")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from cqk_megatron.bench.checkpoints import cluster_estimate, measure, report

    result = measure(args.hidden, args.layers, args.vocab)
    result["cluster"] = cluster_estimate()
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0
