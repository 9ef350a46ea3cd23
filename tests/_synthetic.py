"""A small deterministic dataset shaped like Megatron's GPTDataset samples (tests only).

Each sample is a run of an arithmetic progression modulo the vocabulary, so a tiny model
can learn it and the loss falls; items are a pure function of the index.
"""

from __future__ import annotations

import torch


class ProgressionDataset:
    def __init__(self, vocab_size: int, seq_length: int, size: int = 10_000, seed: int = 0) -> None:
        self.vocab_size, self.seq_length, self.size, self.seed = vocab_size, seq_length, size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = torch.randint(0, self.vocab_size, (1,), generator=generator)
        stride = torch.randint(1, 4, (1,), generator=generator)
        sequence = (start + stride * torch.arange(self.seq_length + 1)) % self.vocab_size
        return {
            "tokens": sequence[:-1],
            "labels": sequence[1:],
            "loss_mask": torch.ones(self.seq_length),
            "position_ids": torch.arange(self.seq_length),
        }
