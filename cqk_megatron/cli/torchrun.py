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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):  # a later --help belongs to the training script
        build_parser().print_help()
        return 0
    from cqk_megatron.parallel.torchrun import main as torchrun_main

    return torchrun_main(argv)
