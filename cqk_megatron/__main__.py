"""``cqk <command>`` (also ``python -m cqk_megatron <command>``): every tool of the stack
under one name. ``cqk <command> --help`` says what each one takes.

Each command is a ``module:function`` looked up when it runs, so ``cqk --help`` and
``cqk X --help`` import only the parser of ``X`` (no torch, no Megatron). The console
scripts of setup.py other than ``cqk`` are the commands' old names, kept as aliases.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from cqk_megatron.cli.quiet import VERBOSE_ENV, quiet_third_party_warnings


@dataclass(frozen=True)
class Command:
    """``target``: ``module:function``, called with the remaining arguments; ``summary``:
    its line in ``cqk --help``; ``prefix``: arguments put before the user's (``cqk status
    X`` is ``cqk status X``); ``subcommands``: a group (``cqk data ...``),
    or, beside a target, the commands its first argument may name (``cqk mqar gap``)."""

    summary: str
    target: str = ""
    prefix: tuple[str, ...] = ()
    subcommands: dict[str, Command] = field(default_factory=dict)


DATA = {
    "tokenizer": Command(
        "train a SentencePiece tokenizer on a corpus", "data_tools.tokenizer:main"
    ),
    "preprocess": Command(
        "tokenize a corpus into an indexed dataset (PREFIX.bin/.idx)", "data_tools.preprocess:main"
    ),
    "stats": Command("token counts and top tokens of indexed datasets", "data_tools.stats:main"),
    "demo-corpus": Command(
        "the embedded demo corpus, its tokenizer and dataset", "data_tools.demo_corpus:main"
    ),
    "bench": Command(
        "time preprocessing against Megatron-LM's tools/preprocess_data.py", "data_tools.bench:main"
    ),
}

COMMANDS: dict[str, Command] = {
    "train": Command(
        "train one run (alone, or as a rank under torchrun/srun)", "cqk_megatron.train:main"
    ),
    "submit": Command("submit runs and sweeps to Slurm or this machine", "launch.submit:main"),
    "status": Command(
        "job state, progress and log tail of run folders", "launch.submit:main", ("status",)
    ),
    "cancel": Command("end the jobs of run folders", "launch.submit:main", ("cancel",)),
    "torchrun": Command(
        "torchrun that exits with the training's own code", "cqk_megatron.cli.torchrun:main"
    ),
    "plan": Command("memory planner: which parallel layouts fit", "cqk_megatron.cli.plan:main"),
    "bench": Command(
        "time the attention variants side by side",
        "cqk_megatron.cli.bench:main",
        subcommands={
            "checkpoints": Command(
                "time a checkpoint save, part by part", "cqk_megatron.cli.bench_checkpoints:main"
            ),
        },
    ),
    "params": Command(
        "parameter counts and each variant's overhead", "cqk_megatron.cli.params:main"
    ),
    "demo": Command(
        "the end-to-end CPU demo (scripts/demo.sh)",
        "cqk_megatron.cli.demo:main",
        subcommands={
            "plain-curves": Command(
                "the Megatron model against the plain model on the demo's data",
                "cqk_megatron.cli.plain_curves:main",
            ),
        },
    ),
    "check": Command(
        "check the install: versions, CUDA/NCCL, a one-rank process group",
        "cqk_megatron.cli.check:main",
    ),
    "data": Command("corpus, tokenizer and dataset tools", subcommands=DATA),
    "convert": Command(
        "run checkpoints to Hugging Face folders and back", "cqk_megatron.cli.convert:main"
    ),
    "analyze": Command("scaling-law analysis over run folders", "cqk_megatron.cli.analyze:main"),
    "mqar": Command(
        "multi-query associative recall benchmark (and its gap and probe studies)",
        "cqk_megatron.cli.mqar:main",
        subcommands={
            "gap": Command(
                "the MQAR gap study, a rung at a time", "cqk_megatron.cli.mqar_gap:main"
            ),
            "probe": Command(
                "one benchmark run with one thing changed", "cqk_megatron.cli.mqar_probe:main"
            ),
        },
    ),
    "repro": Command(
        "the paper's attention comparison in one command", "cqk_megatron.cli.repro:main"
    ),
}


ABOUT = (
    "One command for the cqk-megatron stack (also 'python -m cqk_megatron').\n"
    "'cqk --verbose <command>' also shows the third-party warnings it hides (Megatron-Core's\n"
    "fallbacks when Apex or Transformer Engine is not installed)."
)


def resolve(target: str) -> Callable[..., int | None]:
    """The function ``module:function`` names (its module imported now)."""
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def overview(prog: str, commands: dict[str, Command], what: str) -> str:
    width = max(len(name) for name in commands) + 2
    lines = [f"usage: {prog} <command> [arguments]", "", what, "", "commands:"]
    lines += [f"  {name:<{width}}{command.summary}" for name, command in commands.items()]
    lines += ["", f"'{prog} <command> --help' shows the arguments of one command."]
    return "\n".join(lines)


def dispatch(prog: str, commands: dict[str, Command], argv: list[str], what: str) -> int:
    """Run the command ``argv[0]`` names with the rest of ``argv``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(overview(prog, commands, what))
        return 0
    name, rest = argv[0], argv[1:]
    command = commands.get(name)
    if command is None:
        print(
            f"{prog}: unknown command {name!r}; choose one of: {', '.join(commands)}",
            file=sys.stderr,
        )
        return 2
    prog = f"{prog} {name}"
    if command.subcommands and (not command.target or rest[:1] and rest[0] in command.subcommands):
        return dispatch(prog, command.subcommands, rest, command.summary)
    function = resolve(command.target)
    program, sys.argv[0] = sys.argv[0], prog  # each usage line names the command as typed
    try:
        code = function([*command.prefix, *rest])
    finally:
        sys.argv[0] = program
    return code if isinstance(code, int) else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--verbose"]:  # before the command: the third-party warnings too
        argv = argv[1:]
        os.environ[VERBOSE_ENV] = "1"
    quiet_third_party_warnings()
    return dispatch("cqk", COMMANDS, argv, ABOUT)


if __name__ == "__main__":
    sys.exit(main())
