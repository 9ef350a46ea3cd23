"""Stop cleanly on SIGTERM/SIGUSR1/SIGINT or a wall-clock budget, with every rank agreeing.

A signal only sets a flag; at the next step boundary all ranks all-reduce it (so a
signal that reached one rank stops all of them at the same step), save a checkpoint
and exit with ``cqk_megatron.errors.EXIT_REQUEUE``, which tells the launcher to
requeue the job.

Ctrl-C (SIGINT) is a stop signal too: a person at a terminal presses it, not ``kill
-TERM``, and a ``KeyboardInterrupt`` mid-step lost the steps since the last checkpoint. A
second Ctrl-C (or a SIGTERM after a Ctrl-C) means "now": it raises ``KeyboardInterrupt``
at once, the save in progress is abandoned (its staging folder removed) and the previous
complete checkpoint stays the newest. A SIGINT that was ignored when training started (a
job started in the background by a shell) stays ignored.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from cqk_megatron.training import collectives
from cqk_megatron.training.resilience.orphans import helper_dies_with_parent
from cqk_megatron.training.resilience.writer_queue import WriterResultsManager

__all__ = ["STOP_SIGNALS", "StopRequest", "protect_checkpoint_writer"]
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# A second stop signal that means "now": SIGINT after any stop signal (a second Ctrl-C;
# the local job's controller passes the launcher's second Ctrl-C on so, after the
# SIGTERM of its cancel), and SIGTERM after SIGINT (torchrun's agent, Ctrl-C'd twice,
# sends its workers SIGINT, then SIGTERM).
_NOW_AFTER = {
    signal.SIGINT: STOP_SIGNALS,
    signal.SIGTERM: (signal.SIGINT,),
}


class StopRequest:
    def __init__(self, wall_clock_budget_s: float | None = None) -> None:
        self.started = time.monotonic()
        self.budget = wall_clock_budget_s
        self.signalled: int | None = None
        self._previous = {}
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is signal.SIG_IGN:
                continue  # nohup, or a background job's SIGINT: the caller's choice
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        if self.signalled in _NOW_AFTER.get(signum, ()):
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the save
        self.signalled = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def local_reason(self) -> str | None:
        if self.signalled is not None:
            return signal.Signals(self.signalled).name
        if self.budget is not None and time.monotonic() - self.started > self.budget:
            return "wall-clock budget"
        return None

    def agreed(self) -> bool:
        """Collective: True on every rank if any rank wants to stop."""
        return collectives.any_rank(self.local_reason() is not None)


def protect_checkpoint_writer() -> None:
    """Start Megatron's checkpoint-writer helper process immune to Slurm's stop signals,
    and bound to this process's life.

    Megatron's filesystem writer sends its results through a queue served by a process it
    starts with multiprocessing's *spawn* method, once, at the first save. Slurm signals
    every process of a job step: USR1 before the time limit, TERM on requeue and
    preemption. A freshly spawned interpreter dies of either, so the very save the signal
    asks for then fails with BrokenPipeError (seen on a real Slurm cluster, and with
    ``kill -TERM -<pgid>``). Starting that process before the first save with both signals
    ignored (an ignored disposition survives exec) lets it outlive them; Slurm's SIGKILL at
    the end of the job still ends it. Outside Slurm (torchrun, the local launcher) nothing
    else would: a rank killed with SIGKILL left its helper, deaf to TERM, waiting forever,
    so the helper asks the kernel to kill it when this process ends
    (``orphans.helper_dies_with_parent``, a torch-free module: the helper imports it).
    """
    import torch.multiprocessing as torch_mp

    from cqk_megatron.compat import megatron_state

    if megatron_state.writer_results_queue() is not None:
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        # what filesystem_async._get_write_results_queue makes, with an initializer, and
        # items that stay pickled in the helper (writer_queue.py: it never imports torch)
        manager = WriterResultsManager(ctx=torch_mp.get_context("spawn"))
        manager.start(helper_dies_with_parent, (os.getpid(), _on_main_thread()))
        megatron_state.set_writer_results_queue(manager.PickledQueue())  # the proxy keeps it
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
