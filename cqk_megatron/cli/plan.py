"""``cqk plan``: will a layout fit in GPU memory, and which layouts fit?

    cqk plan --config configs/models/1b.yaml --gpus 8 --gpu-mem 80GiB
        [--micro-batch 1] [--seq 2048] [--zero 1|2|3|distopt|all]
        [--recompute none|selective|full|all] [--recompute-method uniform|block]
        [--recompute-num-layers N] [--tp 2 --pp 1] [--variants coupled] [--all]
        [section.key=value ...]

With ``--tp/--pp`` it prints one layout stage by stage; otherwise every layout of
``--gpus`` GPUs (TP in 1, 2, 4, 8; PP dividing the layers; DP = the rest; each ZeRO
stage) and whether it fits, and with ``--show-overrides`` the ``section.key=value``
overrides that train each layout that fits. All numbers are per GPU, for the pipeline
stage that needs the most. The planner itself is ``cqk_megatron.perf.fit``.

    cqk plan --config configs/runs/1b_4x8.yaml --profile configs/clusters/example_h100.yaml
        [--explain]
    cqk plan --sweep configs/sweeps/ladder.yaml --profile configs/clusters/example_h100.yaml

With ``--profile`` (a cluster profile with a ``hardware:`` block) the layouts that fit
are ranked by the step-time model's predicted tokens/s/GPU, each with its budget
(``--explain``: every collective); ``--gpus`` defaults to the config's world size,
``--gpu-mem`` to the profile's, ``--micro-batch`` to the config's. ``--sweep`` prints each
run's predicted GPU-hours and the sweep's total.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from cqk_megatron.cli.args import add_renamed, new_parser
from cqk_megatron.config import VARIANTS, ConfigError, RunConfig, load_config, validate
from cqk_megatron.model.params import total_parameters
from cqk_megatron.parallel.layout import Layout
from cqk_megatron.perf.fit import (
    TRAINING_SHARDINGS,
    PlanResult,
    format_layouts,
    format_overrides,
    format_stages,
    gib,
    microbatches_per_step,
    normalize_sharding,
    parse_bytes,
    plan_all,
    plan_layout,
    training_config,
)
from cqk_megatron.perf.memory import RECOMPUTE, RECOMPUTE_METHODS
from cqk_megatron.planner.runs import variant_overrides


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("cqk plan", __doc__.split("\n\n")[0])
    parser.add_argument(
        "--config",
        default=None,
        help="model or run config YAML, e.g. configs/models/1b.yaml or configs/runs/1b_4x8.yaml",
    )
    add_size_arguments(parser)
    add_speed_arguments(parser)
    parser.add_argument(
        "--seq", type=int, default=None, help="sequence length (default: model.seq_length)"
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="default: the config's where it divides, else one micro-batch per DP rank "
        "(activations then assume a full pipeline)",
    )
    parser.add_argument("--zero", default="all", help="1, 2, 3 (DeepSpeed), distopt or all")
    parser.add_argument(
        "--recompute", default="none", help=f"train.recompute: {', '.join(RECOMPUTE)} or all"
    )
    parser.add_argument(
        "--recompute-method",
        default="uniform",
        choices=RECOMPUTE_METHODS,
        help="train.recompute_method, for full",
    )
    parser.add_argument(
        "--recompute-num-layers", type=int, default=None, help="train.recompute_num_layers"
    )
    parser.add_argument(
        "--recompute-coupling",
        action="store_true",
        help="attention.recompute_coupling: recompute the coupling in the backward",
    )
    parser.add_argument(
        "--offload-optimizer", action="store_true", help="DeepSpeed: Adam states in CPU memory"
    )
    parser.add_argument("--tp", type=int, default=None, help="one layout: tensor parallel")
    parser.add_argument("--pp", type=int, default=None, help="one layout: pipeline parallel")
    parser.add_argument("--vp", type=int, default=None, help="virtual pipeline chunks")
    parser.add_argument(
        "--sequence-parallel",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: on where TP > 1",
    )
    add_renamed(
        parser,
        "--variants",
        ["--variant"],
        default=None,
        help=f"comma-separated attention variants, each planned in turn, from {list(VARIANTS)} "
        "(default: the config's)",
    )
    parser.add_argument(
        "--precision", default="bf16", choices=("bf16", "fp32"), help="train.precision"
    )
    parser.add_argument("--all", action="store_true", help="list layouts that do not fit too")
    parser.add_argument(
        "--show-overrides",
        action="store_true",
        help="print, for each layout that fits, the section.key=value overrides that train it",
    )
    parser.add_argument(
        "--no-build-check",
        dest="build_check",
        action="store_false",
        help="skip comparing the parameter formula with the model built on the meta device",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    return parser


def add_size_arguments(parser: argparse.ArgumentParser) -> None:
    """How many GPUs, their memory, and the micro-batch."""
    parser.add_argument(
        "--gpus", type=int, default=None, help="number of GPUs (default: parallel.world_size)"
    )
    parser.add_argument(
        "--gpu-mem", default=None, help="memory per GPU (80GiB, 80GB, ...; default: 80GiB)"
    )
    parser.add_argument("--reserve", default="4GiB", help="per-GPU memory kept back")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per micro-batch (default: 1; with --profile the config's)",
    )


def add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    """The step-time model's options (``cli/plan_speed.py``)."""
    parser.add_argument(
        "--profile",
        default=None,
        help="cluster profile with a hardware: block: rank the layouts by predicted speed",
    )
    parser.add_argument(
        "--explain", action="store_true", help="with --profile: every collective of each layout"
    )
    parser.add_argument(
        "--sweep",
        default=None,
        help="with --profile: a sweep file; print each run's predicted GPU-hours and the total",
    )


@dataclass
class Choices:
    """What the command line asks for, read and checked once for every variant."""

    shardings: tuple[str, ...]
    recomputes: tuple[str, ...]
    sequence_parallel: bool | None
    gpu_mem: int
    reserve: int
    variants: list[str | None]
    hardware: object = None  # planner.hardware.ClusterHardware with --profile


def read_choices(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Choices:
    """The options checked (``parser.error`` names the bad one)."""
    variants = [v for v in (args.variants or "").split(",") if v] or [None]
    unknown = [v for v in variants if v is not None and v not in VARIANTS]
    if unknown:
        parser.error(f"--variants {unknown[0]!r} is unknown; choose from {list(VARIANTS)}")
    hardware = read_hardware(args, parser)
    try:
        reserve = parse_bytes(args.reserve)
        gpu_mem = parse_bytes(args.gpu_mem) if args.gpu_mem else None
        if gpu_mem is None:
            gpu_mem = hardware.hbm_bytes if hardware else parse_bytes("80GiB")
        shardings = TRAINING_SHARDINGS if args.zero == "all" else (normalize_sharding(args.zero),)
    except ValueError as error:
        parser.error(str(error))
    refused = [e for e in shardings if e not in TRAINING_SHARDINGS]
    if refused:
        parser.error(
            f"--zero {args.zero}: training has no {refused[0]!r} sharding; use 1, 2, 3 or distopt"
        )
    recomputes = RECOMPUTE if args.recompute == "all" else (args.recompute,)
    if any(r not in RECOMPUTE for r in recomputes):
        parser.error(f"--recompute {args.recompute!r}: choose one of {list(RECOMPUTE)} or all")
    sp = {"auto": None, "on": True, "off": False}[args.sequence_parallel]
    return Choices(shardings, recomputes, sp, gpu_mem, reserve, variants, hardware)


def read_hardware(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """``--profile``'s GPU figures (None without it); ``--explain`` and ``--sweep`` need it."""
    from cqk_megatron.planner.hardware import load_hardware

    if args.profile is None:
        if args.explain or args.sweep:
            parser.error("--explain and --sweep need --profile (a cluster profile's GPU figures)")
        return None
    if args.config is None and args.sweep is None:
        parser.error("give --config (a model or run config) or --sweep (a sweep file)")
    try:
        return load_hardware(args.profile)
    except ConfigError as error:
        parser.error(str(error))


def load_variant_config(args: argparse.Namespace, variant: str | None) -> RunConfig:
    overrides = [f"train.precision={args.precision}", *args.overrides]
    if args.seq is not None:
        overrides.append(f"model.seq_length={args.seq}")
    if args.recompute_coupling:
        overrides.append("attention.recompute_coupling=true")
    return load_plan_config(args.config, variant, overrides)


def check_against_built_model(config: RunConfig) -> None:
    """Build the model on the meta device (seconds, no memory) and compare the totals
    (``cqk params``' check)."""
    from cqk_megatron.bench.overhead import built_differences

    variant = config.attention.variant
    if variant not in VARIANTS:
        return
    row = {"variant": variant, "parameters": total_parameters(config)}
    for line in built_differences(config, [row]):
        print(f"{line}; per-rank memory below is off by that difference")


def plan_options(args: argparse.Namespace, choices: Choices) -> dict:
    """``plan_layout``'s keyword options that the command line sets."""
    return dict(
        reserve_bytes=choices.reserve,
        recompute_coupling=args.recompute_coupling,
        offload_optimizer=args.offload_optimizer,
        config_name=args.config,
    )


def one_layout_results(
    args: argparse.Namespace, parser: argparse.ArgumentParser, config: RunConfig, c: Choices
) -> list[PlanResult]:
    """``--tp/--pp``: that layout with each sharding and recompute choice training accepts
    (the others are printed as refused; none accepted is an error)."""
    tp, pp = args.tp or 1, args.pp or 1
    if args.gpus % (tp * pp):
        parser.error(f"--gpus {args.gpus} is not divisible by TP x PP = {tp * pp}")
    dp = args.gpus // (tp * pp)
    use_sp = (tp > 1) if c.sequence_parallel is None else (c.sequence_parallel and tp > 1)
    layouts, errors = [], []
    for sharding in c.shardings:
        for recompute in c.recomputes:
            full = recompute == "full"
            layout = Layout(
                tp,
                pp,
                dp,
                sharding,
                recompute,
                args.vp,
                use_sp,
                args.recompute_method if full else "uniform",
                args.recompute_num_layers if full else None,
            )
            try:
                built = training_config(
                    config, layout, args.micro_batch, args.global_batch, args.offload_optimizer
                )
                validate(built, args.gpus)
                layouts.append(layout)
            except ConfigError as error:
                errors.append(f"{layout.describe()}: {error}")
    if not layouts:
        parser.error("\n".join(errors))
    for error in errors:
        print(f"refused by training: {error}")
    num_micro = microbatches_per_step(args.global_batch, args.micro_batch, dp)
    options = plan_options(args, c)
    return [
        plan_layout(
            config, layout, args.micro_batch, c.gpu_mem, num_microbatches=num_micro, **options
        )
        for layout in layouts
    ]


def print_one_layout(
    args: argparse.Namespace, config: RunConfig, results: list[PlanResult], c: Choices
) -> int:
    for result in results:
        print(f"\n{result.message}\n{format_stages(result)}")
    print_ranking(args, config, results, c)
    if args.show_overrides:
        print(format_overrides(config, results, args.micro_batch, args.global_batch))
    return 0 if any(r.fits for r in results) else 1


def print_ranking(
    args: argparse.Namespace, config: RunConfig, results: list[PlanResult], c: Choices
) -> None:
    """With ``--profile``: the layouts that fit, fastest first (``cli/plan_speed.py``)."""
    if c.hardware is None or not any(r.fits for r in results):
        return
    from cqk_megatron.cli.plan_speed import format_ranking, rank_layouts

    ranked = rank_layouts(config, results, c.hardware, args.micro_batch, args.global_batch)
    print(f"\nlayouts that fit, fastest first, on {c.hardware.gpu}:")
    print(format_ranking(ranked, args.explain))


def print_every_layout(args: argparse.Namespace, config: RunConfig, c: Choices) -> int:
    """Every layout of ``--gpus`` GPUs; 0 when at least one fits."""
    results = plan_all(
        config,
        args.gpus,
        c.gpu_mem,
        args.micro_batch,
        global_batch=args.global_batch,
        shardings=c.shardings,
        recomputes=c.recomputes,
        sequence_parallel=c.sequence_parallel,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        **plan_options(args, c),
    )
    shown = results if args.all else [r for r in results if r.fits]
    fitting = sum(r.fits for r in results)
    print(
        f"{fitting} of {len(results)} layouts fit (micro-batch {args.micro_batch}, seq "
        f"{config.model.seq_length}, {gib(c.reserve)} reserved per GPU)"
    )
    if shown:
        print(format_layouts(shown))
    print_ranking(args, config, results, c)
    if args.show_overrides and fitting:
        print(format_overrides(config, results, args.micro_batch, args.global_batch))
    return 0 if fitting else 1


def plan_variant(
    args: argparse.Namespace, parser: argparse.ArgumentParser, c: Choices, variant: str | None
) -> int:
    try:
        config = load_variant_config(args, variant)
    except ConfigError as error:
        parser.error(str(error))
    set_config_defaults(args, parser, config, c)
    print(
        f"{args.config}: {config.attention.variant}, {total_parameters(config):,} parameters, "
        f"{args.precision}; {args.gpus} GPUs x {gib(c.gpu_mem)}"
    )
    if args.build_check:
        check_against_built_model(config)
    if args.tp is not None or args.pp is not None:
        return print_one_layout(args, config, one_layout_results(args, parser, config, c), c)
    return print_every_layout(args, config, c)


def set_config_defaults(
    args: argparse.Namespace, parser: argparse.ArgumentParser, config: RunConfig, c: Choices
) -> None:
    """``--gpus`` from ``parallel.world_size``; ``--micro-batch`` 1, or with ``--profile``
    the config's (the speed of its own batch)."""
    if args.gpus is None:
        args.gpus = config.parallel.world_size
        if args.gpus is None:
            parser.error(f"--gpus is needed: {args.config} sets no parallel.world_size")
    if args.micro_batch is None:
        args.micro_batch = config.train.micro_batch_size if c.hardware is not None else 1


def main(argv: list[str] | None = None) -> int:
    """0 when every variant asked for has a layout that fits, else 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    choices = read_choices(args, parser)
    if args.sweep is not None:
        from cqk_megatron.cli.plan_speed import format_sweep_hours

        try:
            print(format_sweep_hours(args.sweep, choices.hardware))
        except ConfigError as error:
            parser.error(str(error))
        return 0
    if args.config is None:
        parser.error("--config is required (or --sweep with --profile)")
    codes = [plan_variant(args, parser, choices, variant) for variant in choices.variants]
    return max(codes)


def load_plan_config(path: str, variant: str | None, overrides: list[str]) -> RunConfig:
    """The model file with ``overrides`` and, if given, ``variant``'s attention, set by the
    experiment planner (``planner.runs.variant_overrides``, last). Not validated here:
    each layout is validated as the training config it stands for."""
    if variant is not None:
        overrides = [*overrides, *variant_overrides(variant)]
    return load_config(path, overrides)
