"""Spawned workers for tests/test_elastic_resume.py (tests only)."""

from __future__ import annotations

from _training import train_attempts


def attempts_then_earlier_format(rank, world_size, port, root, runs, earlier_runs) -> None:
    """``train_attempts`` of ``runs``, then of ``earlier_runs`` with the Megatron engine
    saving its optimizer in the format checkpoints had before ``fully_reshardable``
    (``dp_reshardable``), as checkpoints of runs started before it still hold."""
    train_attempts(rank, world_size, port, root, runs)
    from cqk_megatron.training import megatron_engine

    megatron_engine.OPTIMIZER_FORMAT = megatron_engine.EARLIER_FORMAT
    train_attempts(rank, world_size, port, root, earlier_runs)
