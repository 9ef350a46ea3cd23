"""The watchdog's view of the loop: which phase this rank's main thread is in, so that a
stuck step is named (``training/resilience/``; the heartbeat itself runs on a thread)."""

from __future__ import annotations

from cqk_megatron.training.callbacks.base import Callback, TrainingRun
from cqk_megatron.training.resilience import watchdog


class WatchdogPhases(Callback):
    """``step`` from the start of each step; ``shutdown`` once training is over (last in
    the list: the final save and records come before it). A loop that raised does not
    enter ``shutdown``: an error is the watchdog's to judge."""

    def pre_step(self, run: TrainingRun) -> None:
        watchdog.enter("step", run.state.step + 1)

    def post_train(self, run: TrainingRun) -> None:
        watchdog.enter("shutdown", run.state.step)
