"""``cqk demo plain-curves``: the Megatron model against the plain model on the demo's data.

Each variant's ``w128`` run of ``configs/sweeps/demo_seeds.yaml`` and an independent plain
PyTorch model of the same formula (``eval/plain_model.py``), from the same initial
weights, trained side by side on the same batches; the validation perplexity of each at
every evaluation (``cqk_megatron/eval/plain_curves.py`` says what is shared).

    cqk demo plain-curves --variants standard,coupled,differential --seed 0 --steps 100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cqk_megatron.cli.args import new_parser


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "cqk demo plain-curves", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1]
    )
    parser.add_argument(
        "--variants", default="standard,coupled,differential", help="comma-separated variants"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and data order")
    parser.add_argument("--steps", type=int, default=None, help="shorten every run")
    parser.add_argument("--data", default="demo_out/data", help="the demo corpus's folder")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. attention.X=...")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    data = Path(args.data).resolve()
    if not (data / "demo_text_document.bin").is_file():
        parser.error(f"--data {data}: no demo_text_document.bin; run cqk demo-corpus --out {data}")
    from cqk_megatron.data import build_datasets
    from cqk_megatron.data.checks import run_samples
    from cqk_megatron.eval.plain_curves import (
        demo_run_config,
        format_curves,
        paired_curves,
        shortened,
    )
    from cqk_megatron.parallel.process_groups import init_single_process

    init_single_process()
    extra = [*(shortened(args.steps) if args.steps else []), *args.overrides]
    curves = {}
    for variant in args.variants.split(","):
        config = demo_run_config(variant, args.seed, data, extra)
        train_samples, valid_samples, _ = run_samples(config)
        train, valid, _ = build_datasets(config, train_samples, valid_samples, 0)
        curves[variant] = paired_curves(config, (train, valid))
        print(format_curves({variant: curves[variant]}).splitlines()[-1], flush=True)
    print(format_curves(curves))
    return 0
