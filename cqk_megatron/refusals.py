"""The errors that refuse a run: one base class, ``Refusal``.

A refused run (its folder held by another job, checkpoints that do not verify, bad data or
config, a pre-flight check) ends with ``EXIT_REFUSED`` and one line, is never relaunched
(a relaunch cannot change it), and leaves its folder as it was. Each such error derives
from ``Refusal`` in the torch-free module of its concern (``ConfigError``,
``PreflightError``, ``DataError``, ``CheckpointError``, ``LeaseHeld``).

An error says whether it refuses with ``refuses``: true for a ``Refusal``, except a failed
save (``CheckpointSaveError``), which is a failure unless its disk is full (its
``refuses`` is its ``disk_full``): the run stops with the previous checkpoint intact, and a
relaunch onto the same disk would fail the same way. ``cqk-train``, the launcher's job and
the watchdog all ask :func:`is_refusal`.
"""

from __future__ import annotations


class Refusal(Exception):
    """An error that refuses the run: running it again as it is cannot help."""

    refuses: bool = True


def is_refusal(error: BaseException) -> bool:
    return isinstance(error, Refusal) and error.refuses
