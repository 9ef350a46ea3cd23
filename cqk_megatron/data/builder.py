"""Train/valid/test GPT datasets from ``config.data`` through Megatron's
``BlendedMegatronDatasetBuilder``.

Works in a plain process (no ``torch.distributed``) and in any process group: with one
initialised, Megatron builds the index caches on rank 0 first and the other ranks read
them after a barrier. Everything that can be wrong with the data is checked here first,
with errors that name the field or file and the fix.
"""

from __future__ import annotations

import contextlib
import re
import struct
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core.datasets import blended_dataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split

from cqk_megatron.config import ConfigError, RunConfig
from cqk_megatron.data.errors import DataError
from cqk_megatron.data.metadata import bin_path, idx_path, meta_path, read_meta
from cqk_megatron.data.tokenizer import (
    IdsOnlyTokenizer,
    Tokenizer,
    check_vocab_fits,
    load_tokenizer,
)

_SPLIT = re.compile(r"^\s*\d+(\.\d*)?(\s*,\s*\d+(\.\d*)?){0,2}\s*$")
_MAKE_IT = "make it with cqk-preprocess (or cqk-demo-corpus)"


def _check_split(split: str) -> None:
    if not _SPLIT.match(split) or sum(float(x) for x in split.split(",")) <= 0:
        raise ConfigError(
            f"data.split={split!r} must be one to three comma-separated non-negative "
            "train,valid,test weights with a positive sum, e.g. '969,30,1'"
        )


@dataclass(frozen=True)
class PrefixSize:
    sequences: int  # one per document as cqk-preprocess writes them
    tokens: int


def check_prefix(prefix: str) -> PrefixSize:
    """The .bin/.idx pair exists and belongs together (sizes agree); its size."""
    if prefix.endswith((".bin", ".idx")):
        raise ConfigError(
            f"data.prefixes entry '{prefix}' names a file; give the prefix without "
            f"'.bin'/'.idx': '{prefix[:-4]}'"
        )
    bin_file, idx_file = bin_path(prefix), idx_path(prefix)
    if not bin_file.is_file() and not idx_file.is_file():
        raise DataError(f"dataset '{prefix}' not found (no {bin_file} or {idx_file}); {_MAKE_IT}")
    for present, missing in ((bin_file, idx_file), (idx_file, bin_file)):
        if present.is_file() and not missing.is_file():
            raise DataError(
                f"dataset '{prefix}' is incomplete: {present} exists but {missing} does not; "
                "re-run cqk-preprocess --overwrite for it"
            )
    try:
        index = IndexedDataset(prefix, mmap=False).index  # reads only the .idx
    except (AssertionError, ValueError, OSError, struct.error) as error:
        raise DataError(
            f"dataset '{prefix}': {idx_file} is not a readable Megatron index ({error}); "
            "re-run cqk-preprocess --overwrite for it"
        ) from error
    lengths, pointers = index.sequence_lengths, index.sequence_pointers
    expected = 0 if len(lengths) == 0 else int(pointers[-1]) + int(lengths[-1]) * index.dtype_size
    actual = bin_file.stat().st_size
    if actual != expected:
        raise DataError(
            f"dataset '{prefix}': {bin_file} has {actual} bytes but {idx_file} describes "
            f"{expected}; the two files do not belong together (interrupted copy?); re-run "
            "cqk-preprocess --overwrite for it"
        )
    if len(lengths) == 0:
        raise DataError(f"dataset '{prefix}' holds no documents; {_MAKE_IT} from non-empty input")
    return PrefixSize(len(lengths), int(lengths.sum(dtype=np.int64)))


def resolve_tokenizer(config: RunConfig) -> Tokenizer:
    """``data.tokenizer`` if set; else the tokenizer recorded in the first dataset's metadata
    (the file if it still exists, else its ids and vocabulary size); mock data falls back to
    the model's vocabulary with the last id as EOD."""
    data = config.data
    if data.tokenizer:
        return load_tokenizer(data.tokenizer)
    if data.mock:
        vocab = config.model.vocab_size
        return IdsOnlyTokenizer(vocab_size=vocab, eod=vocab - 1, source="mock data")
    meta = read_meta(data.prefixes[0])
    if meta is None:
        raise ConfigError(
            f"data.tokenizer is not set and dataset '{data.prefixes[0]}' has no "
            f"{meta_path(data.prefixes[0]).name} naming its tokenizer; set "
            "data.tokenizer=path/to/tokenizer.model"
        )
    recorded = meta["tokenizer"]
    if recorded.get("path") and Path(recorded["path"]).exists():
        return load_tokenizer(recorded["path"])
    return IdsOnlyTokenizer(
        vocab_size=int(recorded["vocab_size"]),
        eod=int(recorded["eod"]),
        pad=int(recorded.get("pad", -1)),
        source=str(meta_path(data.prefixes[0])),
    )


def _check_meta_agrees(prefix: str, tokenizer: Tokenizer, config: RunConfig) -> None:
    """A dataset tokenized with another vocabulary would train on garbage silently."""
    meta = read_meta(prefix)
    if meta is None:
        return
    recorded = meta["tokenizer"]
    ours = (tokenizer.vocab_size, tokenizer.eod)
    theirs = (int(recorded["vocab_size"]), int(recorded["eod"]))
    if ours != theirs:
        raise DataError(
            f"dataset '{prefix}' was tokenized with '{recorded.get('path')}' (vocab "
            f"{theirs[0]}, EOD {theirs[1]}) but the tokenizer in use, '{tokenizer.path}', has "
            f"vocab {ours[0]}, EOD {ours[1]}; set data.tokenizer to the dataset's tokenizer or "
            "re-run cqk-preprocess with this one"
        )
    max_id = meta.get("max_token_id")
    if max_id is not None and int(max_id) >= config.model.vocab_size:
        raise ConfigError(
            f"dataset '{prefix}' holds token id {max_id} but model.vocab_size="
            f"{config.model.vocab_size}; set model.vocab_size={int(recorded['vocab_size'])}"
        )


def gpt_dataset_config(
    config: RunConfig,
    tokenizer: Tokenizer,
    create_attention_mask: bool = False,
    weights: list[float] | None = None,
) -> GPTDatasetConfig:
    """Megatron's dataset config for ``config`` (the attention mask is off by default: the
    model's attention applies the causal mask itself); ``weights`` replace
    ``data.weights``."""
    data = config.data
    blend = None if data.mock else (list(data.prefixes), weights or data.weights)
    return GPTDatasetConfig(
        # data.seed fixes the sample order and validation windows across model seeds
        random_seed=config.seed if data.seed is None else data.seed,
        sequence_length=config.model.seq_length,
        blend=blend,
        split=data.split,
        path_to_cache=data.cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=create_attention_mask,
    )


def _check_data_config(config: RunConfig) -> dict[str, PrefixSize]:
    """The size of each prefix, after checking everything about them."""
    data = config.data
    _check_split(data.split)
    if data.mock:
        return {}
    if not data.prefixes:
        raise ConfigError(
            "data.prefixes is empty: list dataset prefixes (e.g. data/demo/demo_text_document "
            "from cqk-demo-corpus), or set data.mock=true for synthetic tokens"
        )
    if data.weights is not None:
        if len(data.weights) != len(data.prefixes):
            raise ConfigError(
                f"data.weights has {len(data.weights)} values for {len(data.prefixes)} "
                "data.prefixes; give one weight per prefix, or null to weigh by size"
            )
        if any(w < 0 for w in data.weights) or sum(data.weights) <= 0:
            raise ConfigError(
                f"data.weights={data.weights} must be non-negative with a positive sum"
            )
    return {prefix: check_prefix(prefix) for prefix in data.prefixes}


def _restrict_splits(
    dataset_config: GPTDatasetConfig, sizes: list[int], prefixes: dict[str, PrefixSize], split: str
) -> None:
    """Skip splits nobody asked samples of, and refuse splits asked of that hold no data.

    Megatron builds every split with a share in ``data.split`` and loops forever on a split
    without documents, so its split matrix is edited (its bookends stay where they are, so
    the other splits keep exactly the same documents)."""
    matrix = dataset_config.split_matrix
    for split_enum in Split:
        i, name = split_enum.value, split_enum.name
        if sizes[i] < 0:
            raise ConfigError(f"{name} samples must be >= 0, got {sizes[i]}")
        if sizes[i] == 0:
            matrix[i] = None
            continue
        if matrix[i] is None:
            raise ConfigError(
                f"{sizes[i]} {name} samples asked for, but data.split={split!r} gives the "
                f"{name} split no share; give it one (e.g. '969,30,1') or ask for 0"
            )
        begin, end = matrix[i]
        for prefix, size in prefixes.items():
            count = size.sequences
            documents = int(round(end * count)) - int(round(begin * count))
            if documents == 0:
                raise DataError(
                    f"data.split={split!r} gives the {name} split 0 of the {count} documents "
                    f"in '{prefix}'; give that split a larger share, use more data, or ask "
                    f"for 0 {name} samples"
                )


def build_datasets(
    config: RunConfig,
    train_samples: int,
    valid_samples: int,
    test_samples: int,
    is_built_on_rank: Callable[[], bool] | None = None,
    create_attention_mask: bool = False,
) -> tuple[Any, Any, Any]:
    """(train, valid, test): Megatron ``GPTDataset`` (one prefix), ``BlendedDataset``
    (several) or ``MockGPTDataset`` (``data.mock``); ``None`` for a split with no samples
    asked for or no share in ``data.split``. Each item is Megatron's sample dict
    (tokens, labels, loss_mask, position_ids)."""
    prefixes = _check_data_config(config)
    tokenizer = resolve_tokenizer(config)
    check_vocab_fits(tokenizer, config)
    if not config.data.mock:
        for prefix in config.data.prefixes:
            _check_meta_agrees(prefix, tokenizer, config)
    sizes = [train_samples, valid_samples, test_samples]
    dataset_class = MockGPTDataset if config.data.mock else GPTDataset
    weights = config.data.weights
    if weights is None and len(prefixes) > 1:
        # "proportional to size" as explicit weights: Megatron then draws as many samples as
        # asked (repeating epochs); without weights it stops after one pass over each prefix
        weights = [float(size.tokens) for size in prefixes.values()]
    dataset_config = gpt_dataset_config(config, tokenizer, create_attention_mask, weights)
    _restrict_splits(dataset_config, sizes, prefixes, config.data.split)
    builder = BlendedMegatronDatasetBuilder(
        dataset_class, sizes, is_built_on_rank or (lambda: True), dataset_config
    )
    with _plain_process_is_rank_zero():
        train, valid, test = builder.build()
    return train, valid, test


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
def _plain_process_is_rank_zero() -> Iterator[None]:
    """Megatron-Core 0.16.1's ``BlendedDataset`` calls ``torch.distributed.get_rank()`` when
    it caches its indices even without a process group (``GPTDataset`` checks
    ``is_initialized()`` first). A process without a group is the only one, rank 0: that
    module alone gets a view of ``torch`` saying so, while the build runs."""
    if torch.distributed.is_initialized():
        yield
        return
    original = blended_dataset.torch
    blended_dataset.torch = _RankZeroTorch()
    try:
        yield
    finally:
        blended_dataset.torch = original


def blend_counts(dataset: Any) -> np.ndarray:
    """How many samples a ``BlendedDataset`` draws from each of its datasets."""
    return np.bincount(np.asarray(dataset.dataset_index), minlength=len(dataset.datasets))
