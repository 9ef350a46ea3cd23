"""The errors that refuse a run before it trains, in one place.

A refused run (its folder held by another job, checkpoints that do not verify, bad data or
config) ends with ``EXIT_REFUSED`` and one line, is never relaunched (a relaunch cannot
change it), and leaves its folder as it was. A failed save is a failure, not a refusal,
unless its disk is full (``CheckpointSaveError.disk_full``): the run stops with the
previous checkpoint intact, and a relaunch onto the same disk would fail the same way.
``cqk-train``, the launcher's job and the watchdog all ask :func:`is_refusal`.

Torch-free: each error class lives in a torch-free module of its own concern.
"""

from __future__ import annotations


def is_refusal(error: BaseException) -> bool:
    from cqk_megatron.checkpoint_files import CheckpointError, CheckpointSaveError
    from cqk_megatron.config import ConfigError
    from cqk_megatron.data.errors import DataError
    from cqk_megatron.run_lease import LeaseHeld

    if isinstance(error, CheckpointSaveError):
        return error.disk_full
    return isinstance(error, (LeaseHeld, CheckpointError, DataError, ConfigError))
