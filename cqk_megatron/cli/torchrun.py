"""``cqk torchrun``: torch's launcher, exiting with the training's own
code (75: requeue, 76: the watchdog ended it) instead of torchrun's 1.

    cqk torchrun --nproc-per-node 4 -m cqk_megatron.train --config RUN.yaml

Every argument is torchrun's (``torchrun --help`` lists them). Added: a worker-save window
when the agent is signalled (``--shutdown-timeout`` 300 s unless given) and SIGUSR1
(Slurm's time-limit warning) forwarded to the workers. ``cqk_megatron.parallel.torchrun`` has the
details.
"""

from __future__ import annotations

import argparse
import sys

from cqk_megatron.cli.args import new_parser
from cqk_megatron.errors import EXIT_REFUSED


def build_parser() -> argparse.ArgumentParser:
    """For ``--help`` only: the arguments go to torchrun as they are."""
    parser = new_parser(
        "cqk torchrun", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1]
    )
    parser.add_argument(
        "torchrun_args",
        nargs=argparse.REMAINDER,
        metavar="TORCHRUN_ARGS",
        help="torchrun's options, then the training script or -m module and its arguments",
    )
    return parser


TRAINING = ("cqk_megatron.train", "cqk_megatron/train.py")
VALUED_OPTIONS = ("--config", "--resume")  # the training's options that take a value


def training_overrides(argv: list[str]) -> list[str]:
    """The ``key=value`` overrides given to the training script (none if it is not
    ``cqk_megatron.train``)."""
    script = next((i for i, a in enumerate(argv) if a.endswith(TRAINING)), None)
    if script is None:
        return []
    overrides, value_next = [], False
    for arg in argv[script + 1 :]:
        if not value_next and not arg.startswith("-") and "=" in arg:
            overrides.append(arg)
        value_next = arg in VALUED_OPTIONS
    return overrides


def repeated_override(argv: list[str]) -> str | None:
    """The refusal of a key that the training's overrides give twice, said here, before
    any rank starts: the ranks would refuse it too, but torchrun ends rank 0 as soon as
    another rank exits, often before rank 0 has said why. None when there is none."""
    from cqk_megatron.config import ConfigError
    from cqk_megatron.config.load import refuse_repeated_overrides

    try:
        refuse_repeated_overrides(training_overrides(argv))
    except ConfigError as error:
        return str(error)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):  # a later --help belongs to the training script
        build_parser().print_help()
        return 0
    refusal = repeated_override(argv)
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return EXIT_REFUSED
    from cqk_megatron.parallel.torchrun import main as torchrun_main

    return torchrun_main(argv)
