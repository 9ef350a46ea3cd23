"""``train.resilience.check_replicas_interval``: copies of a parameter that must agree across ranks
are compared after the interval's steps, and once more at the end (``training/replicas.py``)."""

from __future__ import annotations

from cqk_megatron.training.callbacks.base import Callback, StepOutcome, TrainingRun
from cqk_megatron.training.replicas import ReplicaCheck
from cqk_megatron.training.resilience import watchdog


class ReplicaChecks(Callback):
    """Before a step's weights can be saved (so, before ``Checkpointing`` in the list)."""

    def __init__(self, check: ReplicaCheck) -> None:
        self.check = check

    def post_step(self, run: TrainingRun, outcome: StepOutcome) -> None:
        if self.check.due(run.state.step):
            with watchdog.phase("check_replicas"):
                self.check.run(run.state.step)

    def post_train(self, run: TrainingRun) -> None:
        if run.finished:
            with watchdog.phase("check_replicas"):
                self.check.at_end(run.state.step)
