"""Validation every ``train.eval_interval`` steps, and once more (``final``) at the end."""

from __future__ import annotations

import math

from cqk_megatron.config import RunConfig
from cqk_megatron.run.folder import VALID
from cqk_megatron.training.callbacks.base import Callback, StepOutcome, TrainingRun
from cqk_megatron.training.engines.protocol import Engine
from cqk_megatron.training.resilience import watchdog
from cqk_megatron.training.sampler import fetch, micro_batch_indices


def evaluate(engine: Engine, valid_dataset, config: RunConfig, dp_rank: int, dp: int) -> float:
    """The mean loss over ``train.eval_iters`` global batches from the start of
    ``valid_dataset`` (the same batches at every validation)."""
    t = config.train
    losses = []
    for k in range(t.eval_iters):
        indices = micro_batch_indices(
            k * t.global_batch_size, t.global_batch_size, t.micro_batch_size, dp_rank, dp
        )
        losses.append(engine.eval_loss([fetch(valid_dataset, idx) for idx in indices]))
    return sum(losses) / len(losses)


class Validation(Callback):
    """A ``valid`` record at every ``train.eval_interval``-th step but the last, whose
    validation is the final one, after training (none when the run stops to be requeued)."""

    def post_step(self, run: TrainingRun, outcome: StepOutcome) -> None:
        t, step = run.config.train, run.state.step
        if step % t.eval_interval == 0 and step < t.train_steps:
            self.validate(run)

    def post_train(self, run: TrainingRun) -> None:
        if run.finished:
            self.validate(run, final=True)

    @staticmethod
    def validate(run: TrainingRun, final: bool = False) -> None:
        with watchdog.phase("eval"):
            loss = evaluate(run.engine, run.valid_data, run.config, run.dp_rank, run.dp)
        record = {
            "kind": VALID,
            "step": run.state.step,
            "tokens": run.state.tokens,
            "val_loss": loss,
            "val_ppl": math.exp(min(loss, 50.0)),
        }
        if final:
            record["final"] = True
        run.logger.log(record)
