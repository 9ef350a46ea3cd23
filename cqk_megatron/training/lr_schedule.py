"""Learning-rate schedules as pure functions of the step (so resume needs no state)."""

from __future__ import annotations

import math
from pathlib import Path

from cqk_megatron.config import RunConfig, TrainConfig
from cqk_megatron.config.changes import Change, schedule_changes
from cqk_megatron.run.checkpoint_files import saved_config


def learning_rate(step: int, train: TrainConfig) -> float:
    """The learning rate for optimizer step ``step`` (0-based), ``train.schedule``'s.

    ``cosine``: linear warmup to ``lr``, cosine decay to ``min_lr`` at ``train_steps``.
    ``wsd``: warmup, constant ``lr``, then linear decay to ``min_lr`` over the last
    ``wsd_decay_fraction`` of the steps. ``constant``: warmup, then ``lr``.
    """
    schedule, peak, steps = train.schedule, train.optimizer.lr, train.train_steps
    floor, warmup = schedule.min_lr, schedule.warmup_steps
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    if schedule.decay == "constant":
        return peak
    if schedule.decay == "wsd":
        decay_steps = max(1, round(schedule.wsd_decay_fraction * steps))
        decay_start = steps - decay_steps
        if step < decay_start:
            return peak
        progress = min(1.0, (step - decay_start + 1) / decay_steps)
        return peak - (peak - floor) * progress
    span = max(1, steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def schedule_warning(folder: Path, config: RunConfig, step: int) -> str | None:
    """A warning when the learning-rate schedule differs from the checkpoint's."""
    saved = saved_config(folder)
    if saved is None:
        return None
    found: list[Change] = schedule_changes(saved, config)
    if not found:
        return None
    before, now = learning_rate(step, saved.train), learning_rate(step, config.train)
    return (
        f"warning: the learning-rate schedule differs from checkpoint {folder.name}'s ("
        + ", ".join(str(c) for c in found)
        + f"): the learning rate at step {step} is {now:.3g} where the saved schedule gives "
        f"{before:.3g}; keep the saved values to continue the same schedule"
    )
