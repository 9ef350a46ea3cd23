"""File names of an indexed dataset and the small JSON that records how it was made.

A dataset prefix ``P`` is the pair ``P.bin`` (token ids) and ``P.idx`` (Megatron's index);
``P.meta.json`` records the tokenizer (path, vocabulary size, EOD id), counts and inputs,
so that training can check that the data fits the model without reading the tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cqk_megatron.data.errors import DataError

META_SUFFIX = ".meta.json"


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def meta_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}{META_SUFFIX}")


def holds_dataset(prefix: str | Path) -> bool:
    """Whether anything of a dataset (even half of one) is at ``prefix``."""
    return any(p.exists() for p in (bin_path(prefix), idx_path(prefix), meta_path(prefix)))


def read_meta(prefix: str | Path) -> dict[str, Any] | None:
    path = meta_path(prefix)
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DataError(
            f"dataset metadata '{path}' is unreadable ({error}); re-run cqk data preprocess "
            "--force for this prefix, or delete the file to skip the checks it enables"
        ) from error
    if not isinstance(meta, dict) or not isinstance(meta.get("tokenizer"), dict):
        raise DataError(
            f"dataset metadata '{path}' lacks a 'tokenizer' section; re-run cqk data preprocess"
        )
    return meta


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
