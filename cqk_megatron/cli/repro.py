"""``cqk repro``: the paper's attention comparison in one command.

    cqk repro --preset cpu-tiny
    cqk repro --preset paper-60m --data data/wikitext103/wt103_text_document \\
        --tokens 80M --variants standard,hamiltonian [--seeds 0,1] [train.optimizer.lr=8e-4 ...]
    cqk repro --preset cpu-tiny --family gpt2   # the GPT-2 model family

Trains every variant x seed one after the other, each as a local job of the launcher
(the path of ``cqk submit --cluster local``), with the same data order, schedule and
token budget, then writes ``OUT/comparison.md`` (+ ``.csv``, ``.json``) and
``OUT/loss_vs_tokens.png``. Run it again after an interruption: finished runs are
skipped, a half-finished one resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cqk_megatron.cli.args import HelpFormatter, plain, program
from cqk_megatron.repro.presets import (
    PRESETS,
    ReproError,
    get_preset,
    parse_seeds,
    parse_tokens,
    parse_variants,
)
from data_tools.sources import FORMATS, MAX_INVALID_UTF8, TEXT_UNITS, fraction


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: exit 2 with the usage line
        self.print_usage(sys.stderr)
        raise ReproError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=program("cqk repro"),
        description=plain(__doc__.split("\n\n")[0]),
        epilog=plain(__doc__.split("\n\n", 1)[1]),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--preset", required=True, help=f"one of: {', '.join(PRESETS)}")
    parser.add_argument(
        "--data",
        help="indexed dataset prefix (P.bin/P.idx), a folder holding one, or a corpus file or "
        "folder to tokenize; default: the embedded demo corpus, built into OUT/data",
    )
    parser.add_argument("--tokenizer", help="tokenizer of --data (default: recorded with it)")
    corpus = parser.add_argument_group(
        "a corpus given as --data (passed to the data tools; see cqk data preprocess --help)"
    )
    corpus.add_argument(
        "--text-unit",
        choices=list(TEXT_UNITS),
        default="paragraph",
        help="what one document is in a plain text file: a line, a blank-line-separated "
        "paragraph, or the whole file",
    )
    corpus.add_argument("--text-field", default="text", help="JSONL/Parquet field of the text")
    corpus.add_argument("--input-format", choices=FORMATS, help="override the file extension")
    corpus.add_argument(
        "--max-invalid-utf8",
        type=fraction,
        default=MAX_INVALID_UTF8,
        metavar="FRACTION",
        help="refuse a text/JSONL file with more than this fraction of its bytes in invalid "
        "UTF-8 sequences (default: %(default)s)",
    )
    parser.add_argument("--tokens", help="training tokens per run, e.g. 80M (default: preset's)")
    parser.add_argument(
        "--variants",
        help="comma-separated: standard, hamiltonian (= coupled), euler (= coupled_euler), "
        "mlp_only, invertible, differential, coupled_differential, ... (default: preset's)",
    )
    parser.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1 (default: 0)")
    parser.add_argument(
        "--family",
        choices=["llama", "gpt2"],
        help="model family of every run (default: the preset's, Llama-style); gpt2: learned "
        "positions, LayerNorm, GELU MLP of 4 x hidden, biases",
    )
    parser.add_argument("--out", help="output folder (default: runs/repro/PRESET)")
    parser.add_argument("--nproc", type=int, default=1, help="processes per run")
    parser.add_argument("--quiet", action="store_true", help="training output to logs only")
    parser.add_argument(
        "--time",
        default=None,
        help="time limit of each run's job, Slurm syntax (default 3-00:00:00): the run then "
        "stops with a checkpoint, and the same command resumes it",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value for every run")
    return parser


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run(argv: list[str] | None = None) -> int:
    from cqk_megatron.repro.configs import build_reproduction, check_overrides
    from cqk_megatron.repro.data import CorpusOptions, resolve_data
    from cqk_megatron.repro.runner import TIME_LIMIT, check_same_settings, status, train_run

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    preset = get_preset(args.preset)
    variants = parse_variants(args.variants, preset)
    seeds = parse_seeds(args.seeds, preset)
    tokens = parse_tokens(args.tokens, preset)
    check_overrides(args.overrides)  # before any data is built
    if args.time is not None:
        _check_time(args.time)
    suffix = f"-{args.family}" if args.family else ""
    out = Path(args.out or f"runs/repro/{preset.name}{suffix}").expanduser().resolve()
    cuda = _cuda()
    if preset.name.startswith("paper") and not cuda:
        print(
            f"note: preset {preset.name} on a machine without CUDA runs in fp32 on the CPU "
            "and is very slow; cpu-tiny is the CPU-sized comparison",
            file=sys.stderr,
        )
    reading = CorpusOptions(
        args.text_unit, args.text_field, args.input_format, args.max_invalid_utf8
    )
    data = resolve_data(args.data, args.tokenizer, preset, out, reading)
    reproduction = build_reproduction(
        preset, variants, seeds, tokens, data, out, args.nproc, args.overrides, cuda, args.family
    )
    print(f"preset {preset.name}: {preset.description}")
    print(f"data: {data.description}")
    print(
        f"budget: {reproduction.steps:,} steps x {reproduction.tokens_per_step:,} tokens = "
        f"{reproduction.tokens:,} tokens per run (asked {tokens:,}); "
        f"{len(reproduction.runs)} runs on {args.nproc} process(es)"
    )
    for repro_run in reproduction.runs:
        check_same_settings(repro_run)  # before training anything: refuse early
    _check_data(reproduction.runs)
    for index, repro_run in enumerate(reproduction.runs, start=1):
        state = status(repro_run)
        where = f"[{index}/{len(reproduction.runs)}] {repro_run.name}"
        if state == "done":
            print(f"{where}: done, skipped ({repro_run.run_dir})", flush=True)
            continue
        verb = "resuming from its last checkpoint" if state == "resume" else "training"
        print(f"{where}: {verb} -> {repro_run.run_dir}", flush=True)
        train_run(repro_run, reproduction, echo=not args.quiet, time_limit=args.time or TIME_LIMIT)

    from cqk_megatron.repro.table import variants_markdown, write_comparison

    comparison = write_comparison(reproduction, ["python", "-m", "cqk_megatron.repro", *argv])
    print()
    print(variants_markdown(comparison.table))
    for seed, same in sorted(comparison.same_data.items()):
        if not same:
            print(f"WARNING: the runs of seed {seed} did not see the same first batch")
    print(
        "\nWhere everything is:\n"
        f"  comparison       {comparison.markdown} (+ {comparison.csv.name}, "
        f"{comparison.json.name})\n"
        f"  loss vs tokens   {comparison.plot}\n"
        f"  runs             {out / 'runs'}/<name>/ (config.yaml, metrics.jsonl, train.log, "
        "checkpoints)\n"
        f"  data             {data.prefix} (tokenizer {data.tokenizer})"
    )
    return 0


def _check_time(value: str) -> None:
    from cqk_megatron.config import ConfigError
    from launch.resources import time_minutes

    try:
        time_minutes(value, "--time")
    except ConfigError as error:
        raise ReproError(str(error)) from error


def _check_data(runs) -> None:
    """The data holds enough documents and tokens for every run's splits (a corpus read
    with the wrong --text-unit may be one document), before any training starts."""
    from cqk_megatron.config import ConfigError
    from cqk_megatron.data.checks import check_run_data
    from cqk_megatron.data.errors import DataError

    for repro_run in runs:
        try:
            check_run_data(repro_run.config)
        except (ConfigError, DataError) as error:
            raise ReproError(f"run {repro_run.name}: {error}") from error


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except ReproError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: run the same command again to resume", file=sys.stderr)
        return 130
