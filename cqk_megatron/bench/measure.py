"""Measure the activation memory that autograd keeps, on any device (CPU included).

PyTorch has no allocator statistics on CPU, so the bytes a forward keeps for the
backward are measured with ``torch.autograd.graph.saved_tensors_hooks``: every tensor
saved for the backward passes through the pack hook, and the sum of the sizes of their
distinct storages (a view keeps its whole storage alive), parameters excluded, is the
activation memory held at the end of the forward. All saved storages stay alive until
the backward, so a storage's address identifies it for the whole measurement.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class SavedTensorMeter:
    """Context manager: ``bytes`` = distinct non-parameter storages saved inside it."""

    def __init__(self, exclude: torch.nn.Module | None = None) -> None:
        self.excluded: set[int] = set()
        if exclude is not None:
            self.excluded = {p.untyped_storage().data_ptr() for p in exclude.parameters()}
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.layout == torch.strided and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            if address and address not in self.excluded:
                self.storages.setdefault(address, storage.nbytes())
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def saved_activation_bytes(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes kept for the backward by ``forward()`` (run once, graph then released)."""
    with SavedTensorMeter(exclude=model) as meter:
        output = forward()
    del output
    return meter.bytes
