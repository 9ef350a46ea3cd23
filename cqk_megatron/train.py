"""The main job: ``cqk train --config RUN.yaml [section.key=value ...]`` (``python -m
cqk_megatron.train``, as the launchers start each rank).

Runs under torchrun, ``srun`` or submitit (see ``cqk_megatron.parallel.process_groups``), on CPU
(gloo, fp32) or GPU (NCCL, bf16). Before a process group is built it runs the pre-flight
checks (``cqk_megatron.planner.preflight``: data, tokenizer, run folder and its lease, checkpoints,
disk). A run that finished all of its ``train.train_steps`` trains nothing and changes
nothing, and says so. Exit codes (``cqk_megatron/errors.py``): 0 finished, 75 stopped by a signal or
the wall-clock budget after saving a checkpoint (requeue and run again with ``--resume
auto``; the first Ctrl-C does the same), 130 a second Ctrl-C stopped it at once without
saving, 76 the watchdog ended it (a rank was lost: relaunch), 2 refused before training (a
bad config, data, run folder or checkpoints; one line says why) or at a save onto a full
disk, 1 another error. Under
torchrun, ``cqk torchrun`` keeps these codes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cqk_megatron.cli.args import new_parser
from cqk_megatron.cli.quiet import quiet_third_party_warnings
from cqk_megatron.config import (
    COMMAND_LINE,
    ConfigError,
    TracedConfig,
    explain_config,
    load_config_traced,
    validate,
)
from cqk_megatron.data.errors import DataError
from cqk_megatron.errors import EXIT_INTERRUPTED, EXIT_REFUSED, is_refusal
from cqk_megatron.run.checkpoint_files import RESUME_HELP, CheckpointSaveError
from cqk_megatron.run.lease import LeaseLost
from cqk_megatron.run.unwritable import no_space_error


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = new_parser("cqk train", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument(
        "--config", help="run config YAML, e.g. configs/runs/... (default: the built-in tiny model)"
    )
    parser.add_argument("--resume", default="auto", help=RESUME_HELP)
    parser.add_argument(
        "--skip-preflight", action="store_true", help="start without the pre-flight checks"
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the config that would run (includes and overrides applied; each value "
        "that is not the default says where it was set) and exit without training",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser.parse_args(argv)


def _rank0() -> bool:
    """Rank 0 under torchrun (``RANK``) or a plain ``srun`` (``SLURM_PROCID``), or alone."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def _say(message: str) -> None:
    """Errors once per job, not once per rank."""
    if _rank0():
        print(f"error: {message}", file=sys.stderr, flush=True)


def _launch_world_size() -> int | None:
    """The world size the launcher gives this process, read as ``distributed.discover``
    reads it (torchrun's ``WORLD_SIZE``, srun's ``SLURM_NTASKS``; a plain process is one
    rank) but without importing torch or Megatron: the layout's refusals (a world size that
    the parallel sizes or the batch do not divide) come in a moment, before either loads.
    None where the variables do not read as a number (``discover`` says so later)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        value = env["WORLD_SIZE"]
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        value = env["SLURM_NTASKS"]
    else:
        return 1
    try:
        return int(value)
    except ValueError:
        return None


def _run_folder_line(traced: TracedConfig) -> str:
    from cqk_megatron.run.folder import run_dir_of

    where = traced.sources.get("log.root", "the default")
    folder = run_dir_of(traced.config).resolve()
    return f"run {traced.config.name}: run folder {folder} (log.root from {where})"


def main(argv: list[str] | None = None) -> int:
    quiet_third_party_warnings()  # a rank started as python -m cqk_megatron.train too
    started: dict = {}  # the run's config, once it is known
    try:
        return _main(argv, started)
    except KeyboardInterrupt:  # before the stop handlers, after them, or a second Ctrl-C
        return _interrupted(started.get("config"))


def _interrupted(config) -> int:
    """One line for a Ctrl-C that stopped the process at once, and its exit code."""
    from cqk_megatron.parallel.torchrun import record_exit
    from cqk_megatron.run.checkpoint_files import latest_name
    from cqk_megatron.run.folder import CHECKPOINTS, run_dir_of

    record_exit(EXIT_INTERRUPTED)
    newest = None
    if config is not None:
        checkpoints = run_dir_of(config) / CHECKPOINTS
        newest = latest_name(checkpoints) if checkpoints.is_dir() else None
    kept = (
        f"the newest complete checkpoint is still {checkpoints / newest}"
        if newest
        else "no checkpoint of this run was written"
    )
    if _rank0():
        print(f"interrupted: stopped at once, without saving; {kept}", file=sys.stderr)
    return EXIT_INTERRUPTED


def _main(argv: list[str] | None, started: dict) -> int:
    args = parse_args(argv)
    try:
        traced = load_config_traced(args.config, [(COMMAND_LINE, args.overrides)])
        if args.print_config:  # checked for parallel.world_size, not this one process
            print(explain_config(traced, _run_folder_line(traced)), end="")
            validate(traced.config)
            return 0
        config = validate(traced.config, _launch_world_size())
        from cqk_megatron.planner.preflight import finished_message, preflight

        finished = finished_message(config, args.resume)
        if finished is not None:  # its records stay as they are: no step runs
            if _rank0():
                print(finished, flush=True)
            return 0
        if not args.skip_preflight:
            for note in preflight(config, args.resume):
                if _rank0():
                    print(note, file=sys.stderr)
    except (ConfigError, DataError) as error:
        _say(str(error))
        return EXIT_REFUSED
    except OSError as error:  # the run folder or a data path that the filesystem refuses
        refused = no_space_error(Path(error.filename or "."), error)
        if refused is error:
            raise
        _say(str(refused))
        return EXIT_REFUSED
    from cqk_megatron.parallel.torchrun import record_exit

    started["config"] = config
    try:
        code = _train(config, args.resume)
    except BaseException:
        record_exit(1)
        raise
    record_exit(code)  # for cqk torchrun, whose agent may be signalled before it sees this
    return code


def _train(config, resume: str) -> int:
    """The loop's ``train``, with the refusals and errors it can explain as one line and a
    code."""
    from cqk_megatron.training.collector import heavy_imports
    from cqk_megatron.training.engines import engine_class

    with heavy_imports():  # after the config is checked
        from cqk_megatron.training.loop import train

        engine_class(config.train.engine)  # its module too: the loop finds it by name
    _set_cpu_threads()
    try:
        return train(config, resume=resume)
    except Exception as error:
        # a full disk, a read-only folder, a name too long (``run.folder.NoSpaceError``), at
        # a save or any other write: a rerun would fail the same way
        if is_refusal(error):
            _say(str(error))
            return EXIT_REFUSED
        if isinstance(error, (CheckpointSaveError, LeaseLost)):
            _say(str(error))
            return 1
        raise


def _set_cpu_threads() -> None:
    """On CPU, one share of the usable cores per rank of the node, not torch's one thread
    per core in every rank (``cqk_megatron.parallel.cpu_threads``)."""
    from cqk_megatron.parallel.cpu_threads import set_cpu_threads
    from cqk_megatron.parallel.device import device

    if device().type != "cpu":
        return
    choice = set_cpu_threads()
    if _rank0():
        print(choice.line(), file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
