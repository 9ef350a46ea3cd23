"""``cqk demo``: the stack's jobs end to end on CPU (``scripts/demo.sh``): the embedded
corpus, a tokenizer and dataset, a mini-ladder of 3 sizes x {standard, coupled} as one
sweep, validation perplexity, a Hugging Face export, and the scaling-law report.

Interrupt it and run it again: finished stages and runs are skipped, the others resume.
It needs the repository's checkout (``scripts/``), as an editable install has it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from cqk_megatron.cli.args import new_parser

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "demo.sh"


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("cqk demo", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument(
        "--out", default="demo_out", help="folder for the data, runs, export and report"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="train every run for this many steps (default: the sweep's budget)",
    )
    parser.add_argument("--bootstrap", type=int, default=200, help="the report's resamples")
    parser.add_argument(
        "--install", action="store_true", help="run scripts/install.sh first (a fresh clone)"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        metavar="N",
        help="instead of the mini-ladder: the largest size, standard, coupled, differential "
        "and coupled_differential, seeds 0..N-1, and a table of each variant's perplexity "
        "against standard's on the same seed (configs/sweeps/demo_seeds.yaml)",
    )
    parser.add_argument(
        "--variants",
        default=None,
        metavar="A,B",
        help="with --seeds: only these variants (comma-separated presets, e.g. "
        "differential,coupled_differential)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="with --seeds: config overrides for every run of the study, e.g. "
        "attention.differential_norm=none",
    )
    return parser


def seeds_variants(parser: argparse.ArgumentParser, text: str | None) -> list[str] | None:
    """``--variants``' presets, each checked against the registry."""
    if text is None:
        return None
    from cqk_megatron.variants import VARIANTS, preset_of

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if preset_of(name) is None]
    if unknown or not names:
        parser.error(f"--variants {text!r}: choose presets of {list(VARIANTS)}")
    return [str(preset_of(name)) for name in names]


def demo_environment(args: argparse.Namespace) -> dict[str, str]:
    """``scripts/demo.sh``'s settings (``DEMO_*``) from the flags; its Python environment
    (``VENV``) is this one unless set."""
    env = {"VENV": sys.prefix, **os.environ}
    env |= {"DEMO_OUT": args.out, "DEMO_BOOTSTRAP": str(args.bootstrap)}
    env["DEMO_SKIP_INSTALL"] = "0" if args.install else "1"
    if args.steps is not None:
        env["DEMO_STEPS"] = str(args.steps)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)  # overrides may come between options
    if args.seeds is None and (args.variants is not None or args.overrides):
        parser.error("--variants and config overrides go with --seeds N")
    if args.seeds is not None:
        if args.seeds < 1:
            parser.error(f"--seeds {args.seeds}: give 1 or more (3 tells a gap from noise)")
        from cqk_megatron.cli.demo_seeds import parse_override, run_study

        variants = seeds_variants(parser, args.variants)
        try:
            [parse_override(text) for text in args.overrides]
        except ValueError as error:
            parser.error(str(error))
        out = Path(args.out).resolve()
        return run_study(out, args.seeds, args.steps, variants, args.overrides)
    if not SCRIPT.is_file():
        parser.error(
            f"{SCRIPT} is not there: the demo runs from the repository's checkout; clone it "
            "and install it editable (scripts/install.sh)"
        )
    return subprocess.run(["bash", str(SCRIPT)], env=demo_environment(args)).returncode
