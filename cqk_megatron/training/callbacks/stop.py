"""Stop early to be requeued: on SIGTERM/SIGUSR1 (any rank's), past the wall-clock budget,
or at ``train.resilience.exit_after_steps`` (``training/resilience/preemption.py``). The
checkpoint is saved by ``Checkpointing.post_train``; the loop then returns ``EXIT_REQUEUE``."""

from __future__ import annotations

import torch.distributed as dist

from cqk_megatron.errors import EXIT_REQUEUE
from cqk_megatron.training.callbacks.base import Callback, StepOutcome, TrainingRun
from cqk_megatron.training.resilience.preemption import StopRequest


class StopAndRequeue(Callback):
    def __init__(self) -> None:
        self.stop: StopRequest | None = None

    def pre_train(self, run: TrainingRun) -> None:
        self.stop = StopRequest(
            run.config.train.resilience.wall_clock_budget_s
        )  # installs its handlers

    def post_step(self, run: TrainingRun, outcome: StepOutcome) -> None:
        stopping = self.stop.agreed()  # collective: every rank, every step
        if stopping or run.state.step == run.config.train.resilience.exit_after_steps:
            run.stop_reason = self.stop.local_reason() or (
                "another rank was signalled" if stopping else "train.resilience.exit_after_steps"
            )

    def post_train(self, run: TrainingRun) -> None:
        if run.stop_reason is not None and dist.get_rank() == 0:
            print(
                f"stopping at step {run.state.step} ({run.stop_reason})"
                f"; checkpoint saved, exit {EXIT_REQUEUE} to requeue",
                flush=True,
            )

    def close(self, run: TrainingRun) -> None:
        if self.stop is not None:
            self.stop.restore()
