"""How a run ends badly, in one place (torch-free: the launcher, the local controller and
the Slurm batch script read it without importing torch): the exit codes, and which errors
refuse a run.

Exit codes:

- ``0``: the run finished (or this attempt's work is done).
- ``EXIT_REQUEUE`` (75, EX_TEMPFAIL): stopped on purpose (a signal, the wall-clock budget,
  ``train.resilience.exit_after_steps``) after saving a checkpoint; run it again to resume.
- ``EXIT_WATCHDOG`` (76): the watchdog ended this rank because the job cannot go on: a
  peer died, stopped answering, overran its phase bound, or never arrived at rendezvous.
  The rank that exits with it is a survivor, not the cause; its one-line verdict (and
  ``RUN/faults.jsonl``) names the rank that is. Relaunch from the newest checkpoint.
- ``EXIT_REFUSED`` (2): refused before training (a bad config, data, run folder, lease or
  checkpoints; one line says why), or stopped at a save because the disk is full (the
  previous checkpoint intact; the line names the path and the free space): running it
  again as it is cannot help, so it is not relaunched. ``1``: any other error.
- ``EXIT_INTERRUPTED`` (130, 128 + SIGINT): a second Ctrl-C stopped the process at once,
  without saving (the first one stops like SIGTERM: a save, then 75); the newest complete
  checkpoint is the one before.
- ``EXIT_INJECTED`` (3): a fault drill's ``action=exit``
  (``cqk_megatron.training.resilience.faults``): a bad exit that is none of the above,
  as an unknown failure would be.

Refusals: one base class, ``Refusal``. A refused run (its folder held by another job,
checkpoints that do not verify, bad data or config, a pre-flight check) ends with
``EXIT_REFUSED`` and one line, is never relaunched (a relaunch cannot change it), and
leaves its folder as it was. Each such error derives from ``Refusal`` in the torch-free
module of its concern (``ConfigError``, ``PreflightError``, ``DataError``,
``CheckpointError``, ``LeaseHeld``). An error says whether it refuses with ``refuses``:
true for a ``Refusal``, except a failed save (``CheckpointSaveError``), which is a failure
unless its disk is full (its ``refuses`` is its ``disk_full``): the run stops with the
previous checkpoint intact, and a relaunch onto the same disk would fail the same way.
``cqk train``, the launcher's job and the watchdog all ask :func:`is_refusal`.
"""

from __future__ import annotations

EXIT_REQUEUE = 75
EXIT_WATCHDOG = 76
EXIT_REFUSED = 2
EXIT_INJECTED = 3
EXIT_INTERRUPTED = 130


class Refusal(Exception):
    """An error that refuses the run: running it again as it is cannot help."""

    refuses: bool = True


def is_refusal(error: BaseException) -> bool:
    return isinstance(error, Refusal) and error.refuses
