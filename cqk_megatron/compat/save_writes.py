"""The file writes inside Megatron-Core's and DeepSpeed's collective saves, replaced for
the length of one save (``training/checkpoint.guarded_writes`` says what the replacement
does: it records each path and defers a failed write past the library's collectives)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

PathOf = Callable[..., Path | None]  # the path a call of a write function writes
Wrap = Callable[[Callable, PathOf], Callable]


def _path_arg(position: int, name: str, inside: str = "") -> PathOf:
    """The path a write function is given (argument ``position`` or ``name``), joined
    with ``inside`` when it is a folder the function writes a file in."""

    def path_of(*args, **kwargs) -> Path | None:
        value = args[position] if len(args) > position else kwargs.get(name)
        return Path(value, inside) if isinstance(value, str | os.PathLike) else None

    return path_of


def write_functions() -> list[tuple[object, str, PathOf]]:
    """(owner, attribute, the path it writes) of each rank-local file write made between
    two collectives of a library's save."""
    from megatron.core.dist_checkpointing import serialization

    found = [
        (torch, "save", _path_arg(1, "f")),  # Megatron's common.pt, DeepSpeed's files
        (serialization, "save_config", _path_arg(1, "checkpoint_dir", "metadata.json")),
    ]
    deepspeed_engine = sys.modules.get("deepspeed.runtime.engine")
    if deepspeed_engine is not None:  # rank 0 copies zero_to_fp32.py before a barrier
        found.append((deepspeed_engine, "copyfile", _path_arg(1, "dst")))
    return found


@contextlib.contextmanager
def replaced(wrap: Wrap) -> Iterator[None]:
    """Each of ``write_functions()`` replaced by ``wrap(original, path_of)`` until exit."""
    patched = []
    for owner, name, path_of in write_functions():
        original = getattr(owner, name)
        patched.append((owner, name, original))
        setattr(owner, name, wrap(original, path_of))
    try:
        yield
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)
