"""``cqk params``: parameter counts and the overhead of each attention
variant over standard attention.

The table is the experiment planner's count (no Megatron model is built, no process group
started) of each variant's config as the planner makes it (TP=1, PP=1). As a check, the
real Megatron ``GPTModel`` is also built on the meta device (no memory: 7B counts are
instant) and a difference is reported; ``--no-build-check`` skips that.
"""

from __future__ import annotations

import argparse
import sys

from cqk_megatron.bench.overhead import built_differences, format_table, overhead_table
from cqk_megatron.cli.args import new_parser
from cqk_megatron.config import VARIANTS, load_config
from cqk_megatron.variants import UnknownVariantError, pair


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "cqk params",
        __doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--config",
        default=None,
        help="model or run config YAML (default: the built-in tiny model)",
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated variant names"
    )
    parser.add_argument(
        "--no-build-check",
        dest="build_check",
        action="store_false",
        help="skip comparing the planner's count with the model built on the meta device",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    variants = [v for v in args.variants.split(",") if v]
    for variant in variants:
        try:
            pair(variant)
        except UnknownVariantError as error:
            parser.error(str(error))
    rows = overhead_table(config, variants)
    print(format_table(rows))
    if args.build_check:
        for line in built_differences(config, rows):
            print(line, file=sys.stderr)
    return 0
