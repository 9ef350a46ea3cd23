"""What the training step and its callbacks share, and the one place that calls the hooks.

Read against OLMo-core's ``olmo_core/train/callbacks/callback.py``: a ``Callback`` has a
method per moment of the loop and does nothing by default; ``Callbacks`` calls each hook on
every callback in the order the list was built (``loop.callbacks_in_order``), so that the
order of a step's side effects (its metrics record, the replica check, validation, the
save, the stop decision) is written down once. ``close`` runs in reverse order, as nested
``with`` blocks unwind, and also when a hook or the step raised, after ``on_error``.

A caller of ``loop.train`` adds its own callbacks (``train(config, callbacks=[...])``); what
their ``state_dict`` returns is saved in each checkpoint and handed back to
``load_state_dict`` when a run resumes from it (``CallbackStates``), as OLMo-core's trainer
does for its callbacks.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cqk_megatron.config import RunConfig
from cqk_megatron.training.checkpoint import TrainerState
from cqk_megatron.training.engines.protocol import Engine, StepResult
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

    def on_error(self, run: TrainingRun, error: BaseException) -> None:
        """When the step or a hook raised ``error``, before ``close``; the loop raises it
        again afterwards (a failure here is printed, and does not replace it)."""

    def close(self, run: TrainingRun) -> None:
        """Always, last: release what ``pre_train`` (or the constructor) took."""

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of this callback (None: nothing); host objects only."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``state_dict()``'s value from the checkpoint the run resumes from; not called
        when that checkpoint holds none for ``state_key``."""

    @property
    def state_key(self) -> str:
        """Where a checkpoint keeps this callback's state: its class, by default (two
        callbacks of one class that both keep state must override it)."""
        return f"{type(self).__module__}.{type(self).__qualname__}"


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

    def on_error(self, run: TrainingRun, error: BaseException) -> None:
        for callback in self.callbacks:
            try:
                callback.on_error(run, error)
            except Exception as failure:  # the run's own error is the one to raise
                print(
                    f"error: {type(callback).__name__}.on_error failed ({failure}) while "
                    f"handling: {error}",
                    file=sys.stderr,
                )

    def close(self, run: TrainingRun) -> None:
        for callback in reversed(self.callbacks):
            callback.close(run)


class CallbackStates(Callback):
    """Keeps the added callbacks' ``state_dict`` in ``run.state.callbacks`` after every
    step, so that a checkpoint saved by the callbacks after it holds them; ``restore``
    hands a resumed run's saved states back. Placed after the added callbacks' own
    ``post_step`` and before ``Checkpointing``'s (``loop.callbacks_in_order``)."""

    def __init__(self, added: Sequence[Callback]) -> None:
        keys = [c.state_key for c in added]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(
                f"callbacks {', '.join(twice)} are added more than once: give each a "
                "state_key of its own"
            )
        self.added = tuple(added)

    def restore(self, state: TrainerState) -> None:
        for callback in self.added:
            if callback.state_key in state.callbacks:
                callback.load_state_dict(state.callbacks[callback.state_key])

    def post_step(self, run: TrainingRun, outcome: StepOutcome) -> None:
        kept = ((c.state_key, c.state_dict()) for c in self.added)
        run.state.callbacks = {key: value for key, value in kept if value is not None}
