"""Weights as safetensors, sharded above a size, the way transformers names them.

One file ``model.safetensors`` up to ``max_shard_bytes``; above it
``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json`` mapping every
tensor to its shard.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from cqk_megatron.convert.errors import ConversionError
from cqk_megatron.convert.options import DEFAULT_MAX_SHARD
from cqk_megatron.run.atomic import atomic_path, write_text_atomically

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(size: int | str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a byte count -> bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)
    if match is None or match[2].upper() not in _UNITS:
        raise ConversionError(f"shard size {size!r} is not a size like 5GB, 500MB or 2GiB")
    return int(float(match[1]) * _UNITS[match[2].upper()])


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and used + size > max_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = tensor
        used += size
    return shards


def save_weights(
    tensors: dict[str, torch.Tensor], folder: Path, max_shard_size: int | str = DEFAULT_MAX_SHARD
) -> list[str]:
    """Write ``tensors`` into ``folder``; returns the file names written."""
    # safetensors refuses shared or strided storage: give every tensor its own copy
    owned = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    shards = _shards(owned, parse_size(max_shard_size))
    metadata = {"format": "pt"}
    if len(shards) == 1:
        with atomic_path(folder / SINGLE_FILE) as temporary:
            save_file(shards[0], temporary, metadata=metadata)
        return [SINGLE_FILE]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        with atomic_path(folder / name) as temporary:
            save_file(shard, temporary, metadata=metadata)
        names.append(name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in owned.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_text_atomically(folder / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    return [*names, INDEX_FILE]


def has_weights(folder: Path) -> bool:
    return (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face folder (single file or sharded with an index)."""
    if (folder / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as error:
            raise ConversionError(
                f"{folder / INDEX_FILE}: not a safetensors index ({error})"
            ) from error
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise ConversionError(
            f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}; only safetensors weights are read "
            "(re-save the model with save_pretrained(safe_serialization=True))"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise ConversionError(
                f"{path}: listed in {INDEX_FILE} but missing; the copy is incomplete"
            )
        try:
            tensors.update(load_file(path))
        except (SafetensorError, OSError) as error:
            raise ConversionError(f"{path}: unreadable safetensors file ({error})") from error
    return tensors
