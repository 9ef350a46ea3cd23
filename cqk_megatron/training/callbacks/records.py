"""The run's record of what ran: after an attempt's first step, rank 0 writes its settings
and start step to ``history.jsonl`` and its config to ``config.yaml``
(``cqk_megatron.run.history``), so that neither names settings no step ran under."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from cqk_megatron.run.history import record_attempt
from cqk_megatron.training.callbacks.base import Callback, StepOutcome, TrainingRun


class RunRecords(Callback):
    def __init__(self, run_dir: Path, start_step: int) -> None:
        self.run_dir = run_dir
        self.start_step = start_step
        self.recorded = False

    def post_step(self, run: TrainingRun, outcome: StepOutcome) -> None:
        if self.recorded:
            return
        self.recorded = True
        if dist.get_rank() == 0:
            record_attempt(self.run_dir, run.config, self.start_step)
