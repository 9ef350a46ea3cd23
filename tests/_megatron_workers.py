"""Workers that run the real training loop with ``train.engine=megatron`` (tests only)."""

from __future__ import annotations

from _training import save_initial_weights, train_runs


def initial_weights_then_train_runs(rank, world_size, port, root, inits, runs) -> None:
    """``save_initial_weights`` then ``train_runs`` in one start of the ranks."""
    save_initial_weights(rank, world_size, port, root, inits)
    train_runs(rank, world_size, port, root, runs)
