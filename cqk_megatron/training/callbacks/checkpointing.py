"""Checkpoints every ``train.checkpoint.save_interval`` steps and at the end of the run, finished or
stopped to be requeued (``training/async_save.Saver``: synchronous or asynchronous)."""

from __future__ import annotations

from cqk_megatron.training.async_save import Saver
from cqk_megatron.training.callbacks.base import Callback, StepOutcome, TrainingRun
from cqk_megatron.training.resilience.preemption import protect_checkpoint_writer


class Checkpointing(Callback):
    def __init__(self, saver: Saver, run: TrainingRun) -> None:
        self.saver = saver
        self.last_saved = run.state.step  # a resumed run's step is saved already

    def pre_train(self, run: TrainingRun) -> None:
        protect_checkpoint_writer()  # before any save, and before StopAndRequeue's handlers

    def post_step(self, run: TrainingRun, outcome: StepOutcome) -> None:
        step = run.state.step
        self.saver.poll(step)  # an asynchronous save is committed once written
        if step % run.config.train.checkpoint.save_interval == 0:
            self.save(run)

    def post_train(self, run: TrainingRun) -> None:
        """The last step's checkpoint, unless just saved; then the save in flight is
        committed (a requeue's exit waits for it too)."""
        if self.last_saved != run.state.step:
            self.save(run)
        self.saver.finish()

    def save(self, run: TrainingRun) -> None:
        self.saver.save(run.state)
        self.last_saved = run.state.step
