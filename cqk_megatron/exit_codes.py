"""The exit codes a training process ends with, in one place (torch-free: the launcher,
the local controller and the Slurm batch script read them without importing torch).

- ``0``: the run finished (or this attempt's work is done).
- ``EXIT_REQUEUE`` (75, EX_TEMPFAIL): stopped on purpose (a signal, the wall-clock budget,
  ``train.exit_after_steps``) after saving a checkpoint; run it again to resume.
- ``EXIT_WATCHDOG`` (76): the watchdog ended this rank because the job cannot go on: a
  peer died, stopped answering, overran its phase bound, or never arrived at rendezvous.
  The rank that exits with it is a survivor, not the cause; its one-line verdict (and
  ``RUN/faults.jsonl``) names the rank that is. Relaunch from the newest checkpoint.
- ``EXIT_REFUSED`` (2): refused before training (a bad config, data, run folder, lease or
  checkpoints; one line says why), or stopped at a save because the disk is full (the
  previous checkpoint intact; the line names the path and the free space): running it
  again as it is cannot help, so it is not relaunched. ``1``: any other error.
- ``EXIT_INJECTED`` (3): a fault drill's ``action=exit`` (``cqk_megatron.training.faults``):
  a bad exit that is none of the above, as an unknown failure would be.
"""

from __future__ import annotations

EXIT_REQUEUE = 75
EXIT_WATCHDOG = 76
EXIT_REFUSED = 2
EXIT_INJECTED = 3
