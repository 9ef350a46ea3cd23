"""``cqk bench``: time the attention variants against standard attention, in
one run.

Builds the same model config with each variant (all resident at once), then times
forward + backward (+ an optimizer step with ``--optimizer adamw``) interleaved, ``A B C A
B C ...``, and reports per variant the median step time, tokens/s, the ratio to standard
attention, FLOPs per token, MFU (GPU), activation memory (measured and the planner's
estimate) and the attention kernels that ran. ``cqk_megatron.bench.variants`` has the details.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from cqk_megatron.cli.args import new_parser
from cqk_megatron.config import VARIANTS, ConfigError, RunConfig

DEFAULT_VARIANTS = "standard,coupled,differential"
CLOCK_NAMES = ("wall", "cpu")  # bench.variants.CLOCKS, which run_benchmark checks


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "cqk bench",
        __doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--config",
        default="tiny",
        help="tiny (a CPU-sized model built in) or a model or run config YAML",
    )
    parser.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help="comma-separated names, each optionally tagged @eager, @compiled, @reference, "
        "@recompute, and on differential variants @paired or @split (e.g. "
        "standard,coupled,coupled@compiled,differential@paired,differential@split)",
    )
    parser.add_argument("--steps", type=int, default=5, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument(
        "--micro-batch", type=int, default=None, help="default: train.micro_batch_size"
    )
    parser.add_argument("--seq", type=int, default=None, help="default: model.seq_length")
    parser.add_argument(
        "--attention-only", action="store_true", help="time one attention layer, not the model"
    )
    parser.add_argument(
        "--optimizer",
        choices=("none", "adamw"),
        default="none",
        help="adamw: time an optimizer step too",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default=None,
        help="default: bf16 on GPU, the config's on CPU",
    )
    parser.add_argument(
        "--clock",
        choices=CLOCK_NAMES,
        default="wall",
        help="wall, or cpu: process CPU time, for a CPU shared with other jobs",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's)"
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    return parser


def parse_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RunConfig:
    """The benchmark's config, each variant checked (``parser.error`` names a bad one)."""
    import torch

    from cqk_megatron.bench.variants import load_bench_config, split_variant, variant_of

    variants = [v for v in args.variants.split(",") if v]
    if not variants:
        parser.error(f"--variants: none given; choose from {list(VARIANTS)}")
    for variant in variants:
        try:
            split_variant(variant)
        except ValueError as error:
            parser.error(f"--variants: {error}")
    args.variant_list = variants
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    overrides = list(args.overrides)
    if args.seq is not None:
        overrides.append(f"model.seq_length={args.seq}")
    precision = args.precision or ("bf16" if torch.cuda.is_available() else None)
    if precision is not None:
        overrides.append(f"train.precision={precision}")
    try:
        config = load_bench_config(args.config, overrides)
        for variant in variants:
            variant_of(config, variant)
    except ConfigError as error:
        parser.error(str(error))
    return config


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    parser = build_parser()
    args = parser.parse_args(argv)
    config = parse_config(args, parser)

    import torch

    from cqk_megatron.bench.variants import format_report, run_benchmark, write_json

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = run_benchmark(
        config,
        args.variant_list,
        rounds=args.steps,
        warmup=args.warmup,
        micro_batch=args.micro_batch,
        attention_only=args.attention_only,
        optimizer=args.optimizer,
        clock=args.clock,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(format_report(result))
    if args.json:
        write_json(result, args.json)
    return 0
