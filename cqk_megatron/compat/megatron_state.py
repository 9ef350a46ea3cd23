"""Megatron-Core 0.16's module state that this package sets: two private globals, and the
view of ``torch`` its blended dataset gets outside a process group (``compat.PATCHES``
says why each is needed and what would retire it)."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch


def forget_embedding_ranks() -> None:
    """What ``destroy_model_parallel`` leaves behind: the tied embedding's ranks, which
    ``initialize_model_parallel`` sets only on the ranks of the group. After a PP=2
    layout, a middle stage of PP=4 in the same process thought itself a holder of the
    tied embedding (``is_rank_in_embedding_group``) and asked for a group it did not have."""
    from megatron.core import parallel_state

    parallel_state._EMBEDDING_GLOBAL_RANKS = None


def writer_results_queue() -> Any:
    """The queue Megatron's asynchronous checkpoint writer reports its results through,
    if one has been made in this process (None otherwise)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return filesystem_async._results_queue


def set_writer_results_queue(queue: Any) -> None:
    """Make ``queue`` the one ``filesystem_async._get_write_results_queue`` returns (it
    makes its own only when the global is None)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue


class _RankZeroDistributed(types.SimpleNamespace):
    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)


class _RankZeroTorch(types.ModuleType):
    """``torch`` whose ``distributed.get_rank()`` answers 0; everything else is ``torch``."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.distributed = _RankZeroDistributed(get_rank=lambda *args, **kwargs: 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def blended_dataset_outside_a_group() -> Iterator[None]:
    """Megatron-Core 0.16.1's ``BlendedDataset`` calls ``torch.distributed.get_rank()`` when
    it caches its indices even without a process group (``GPTDataset`` checks
    ``is_initialized()`` first). A process without a group is the only one, rank 0: that
    module alone gets a view of ``torch`` saying so, while the build runs."""
    from megatron.core.datasets import blended_dataset

    if torch.distributed.is_initialized():
        yield
        return
    original = blended_dataset.torch
    blended_dataset.torch = _RankZeroTorch()
    try:
        yield
    finally:
        blended_dataset.torch = original
