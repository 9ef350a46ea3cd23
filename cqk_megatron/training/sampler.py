"""Which samples each data-parallel rank reads at each step.

The order is a pure function of ``consumed_samples``: global batch ``k`` is samples
``[k G, (k+1) G)`` of the (already shuffled) Megatron dataset, data-parallel rank ``r``
takes the ``r``-th contiguous slice, split into micro-batches. Resuming therefore only
needs the number of samples consumed: nothing is repeated or skipped.

``fetch`` is how every batch reaches a model: collated on the host, then on this rank's
device through ``cqk_megatron.parallel.device.to_device`` (pinned memory, non-blocking, on GPU).
"""

from __future__ import annotations

import torch
from torch.utils.data import default_collate

from cqk_megatron.parallel.device import to_device


def micro_batch_indices(
    consumed_samples: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int
) -> list[list[int]]:
    """Dataset indices of this rank's micro-batches for the global batch at ``consumed``."""
    per_rank = global_batch // dp_size
    start = consumed_samples + dp_rank * per_rank
    return [
        list(range(start + m, start + m + micro_batch)) for m in range(0, per_rank, micro_batch)
    ]


def collate(dataset, indices: list[int]) -> dict[str, torch.Tensor]:
    """A collated micro-batch in host memory; indices wrap around the dataset's length."""
    return default_collate([dataset[i % len(dataset)] for i in indices])


def fetch(dataset, indices: list[int]) -> dict[str, torch.Tensor]:
    """The micro-batch ``collate`` gives, on this rank's device: what a model is fed."""
    return to_device(collate(dataset, indices))
