"""What the training step and its callbacks share, and the one place that calls the hooks.

Read against OLMo-core's ``olmo_core/train/callbacks/callback.py``: a ``Callback`` has a
method per moment of the loop and does nothing by default; ``Callbacks`` calls each hook on
every callback in the order the list was built (``loop.callbacks_in_order``), so that the
order of a step's side effects (its metrics record, the replica check, validation, the
save, the stop decision) is written down once. ``close`` runs in reverse order, as nested
``with`` blocks unwind, and also when a hook or the step raised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cqk_megatron.config import RunConfig
from cqk_megatron.training.checkpoint import TrainerState
from cqk_megatron.training.engine import Engine, StepResult
from cqk_megatron.training.metrics import MetricsLogger


@dataclass
class TrainingRun:
    """One run's state as the step and the callbacks see it."""

    config: RunConfig
    state: TrainerState  # what a checkpoint saves: step, samples and tokens consumed
    engine: Engine
    train_data: Any
    valid_data: Any
    logger: MetricsLogger  # rank 0 writes metrics.jsonl; a no-op on the other ranks
    dp_rank: int
    dp: int
    # Set by a callback's post_step to end the loop early (the run exits to be requeued).
    stop_reason: str | None = None

    @property
    def finished(self) -> bool:
        """Every step trained and no stop asked for: the end-of-run work is due."""
        return self.stop_reason is None and self.state.step >= self.config.train.train_steps


@dataclass(frozen=True)
class StepOutcome:
    """What one training step produced, for the post_step hooks."""

    lr: float
    result: StepResult
    step_time_s: float  # data loading and the engine's step


class Callback:
    """A part of the loop around the step; override the hooks it needs. Every hook is
    called on every rank (some are collective: they must run in the same order there)."""

    def pre_train(self, run: TrainingRun) -> None:
        """Once, before the first step (also when there is no step left to train)."""

    def pre_step(self, run: TrainingRun) -> None:
        """Before step ``run.state.step + 1`` begins."""

    def post_step(self, run: TrainingRun, outcome: StepOutcome) -> None:
        """After the step; ``run.state.step`` is the step just trained."""

    def post_train(self, run: TrainingRun) -> None:
        """Once, after the last step, or after the step a stop was agreed at
        (``run.stop_reason`` set). Not called when the loop raised."""

    def close(self, run: TrainingRun) -> None:
        """Always, last: release what ``pre_train`` (or the constructor) took."""


class Callbacks:
    """The callbacks of one run, in order; calling a hook calls it on each of them."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = tuple(callbacks)

    def pre_train(self, run: TrainingRun) -> None:
        for callback in self.callbacks:
            callback.pre_train(run)

    def pre_step(self, run: TrainingRun) -> None:
        for callback in self.callbacks:
            callback.pre_step(run)

    def post_step(self, run: TrainingRun, outcome: StepOutcome) -> None:
        for callback in self.callbacks:
            callback.post_step(run, outcome)

    def post_train(self, run: TrainingRun) -> None:
        for callback in self.callbacks:
            callback.post_train(run)

    def close(self, run: TrainingRun) -> None:
        for callback in reversed(self.callbacks):
            callback.close(run)
