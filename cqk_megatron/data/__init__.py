"""The training side of the data: tokenizers and Megatron GPT datasets over ``.bin/.idx``.

``build_datasets`` imports Megatron-Core (slow); it is loaded on first use so that the
tokenizer can be imported by light worker processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cqk_megatron.data.errors import DataError
from cqk_megatron.data.tokenizer import Tokenizer, check_vocab_fits, load_tokenizer

if TYPE_CHECKING:
    from cqk_megatron.data.builder import build_datasets, gpt_dataset_config

__all__ = [
    "DataError",
    "Tokenizer",
    "build_datasets",
    "check_vocab_fits",
    "gpt_dataset_config",
    "load_tokenizer",
]


def __getattr__(name: str) -> Any:
    if name in ("build_datasets", "gpt_dataset_config"):
        from cqk_megatron.data import builder

        return getattr(builder, name)
    raise AttributeError(f"module 'cqk_megatron.data' has no attribute {name!r}")
