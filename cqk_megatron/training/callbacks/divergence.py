"""Stop a run whose updates keep being skipped for non-finite gradients."""

from __future__ import annotations

from cqk_megatron.training.callbacks.base import Callback, StepOutcome, TrainingRun


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. non-finite losses step after step)."""


class NonFiniteGuard(Callback):
    """Raise after ``train.resilience.max_nan_steps`` skipped steps in a row (after the last one's
    ``train`` record is written, so that the record shows it)."""

    def post_step(self, run: TrainingRun, outcome: StepOutcome) -> None:
        state = run.state
        if state.skipped_in_a_row >= run.config.train.resilience.max_nan_steps:
            raise TrainingError(
                f"{state.skipped_in_a_row} steps in a row had non-finite gradients "
                f"(last loss {outcome.result.loss}); stopping at step {state.step}. Lower "
                "train.optimizer.lr, check the data, or resume from an earlier checkpoint."
            )
