"""The main job: ``python -m cqk_megatron.train --config RUN.yaml [section.key=value ...]``.

Runs under torchrun, ``srun`` or submitit (see ``cqk_megatron.distributed``), on CPU
(gloo, fp32) or GPU (NCCL, bf16). Exit codes (``cqk_megatron/exit_codes.py``): 0 finished,
75 stopped by a signal or the wall-clock budget after saving a checkpoint (requeue and run
again with ``--resume auto``), 76 the watchdog ended it (a rank was lost: relaunch), 2 a bad
config, 1 another error. Under torchrun, ``cqk-torchrun`` keeps these codes.
"""

from __future__ import annotations

import argparse
import sys

from cqk_megatron.config import ConfigError, load_config, validate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="run config YAML (default: the built-in tiny model)")
    parser.add_argument(
        "--resume",
        default="auto",
        help="auto: newest complete checkpoint of the run, if any; none; or a checkpoint folder",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = validate(load_config(args.config, args.overrides))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from cqk_megatron.torchrun import record_exit
    from cqk_megatron.training.loop import train  # heavy imports after the config is checked

    try:
        code = train(config, resume=args.resume)
    except BaseException:
        record_exit(1)
        raise
    record_exit(code)  # for cqk-torchrun, whose agent may be signalled before it sees this
    return code


if __name__ == "__main__":
    sys.exit(main())
