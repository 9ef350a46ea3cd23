"""Train/valid/test GPT datasets from ``config.data`` through Megatron's
``BlendedMegatronDatasetBuilder``.

Works in a plain process (no ``torch.distributed``) and in any process group: with one
initialised, Megatron builds the index caches on rank 0 first and the other ranks read
them after a barrier. Everything that can be wrong with the data is checked here first,
with errors that name the field or file and the fix (``cqk_megatron.data.checks``, which
the launcher runs too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import Split

from cqk_megatron.compat import megatron_state
from cqk_megatron.config import RunConfig
from cqk_megatron.data.checks import (  # noqa: F401 - check_prefix, resolve_tokenizer: API
    PrefixSize,
    check_data_config,
    check_prefix,
    check_splits,
    check_tokenizer,
    resolve_tokenizer,
)
from cqk_megatron.data.tokenizer import Tokenizer
from cqk_megatron.run.folder import run_dir_of

INDEX_CACHE = "index_cache"  # in the run folder, where data.cache_dir is unset


def index_cache_dir(config: RunConfig) -> str | None:
    """Where Megatron caches the datasets' sample indices: ``data.cache_dir``, else the run
    folder's ``index_cache/``. Never Megatron's own default (a ``cache/`` folder under the
    data prefix): a data folder is often read-only or shared by many runs. Mock data is
    not cached (Megatron's default for it)."""
    if config.data.cache_dir is not None:
        return config.data.cache_dir
    if config.data.mock:
        return None
    return str(run_dir_of(config) / INDEX_CACHE)


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
        path_to_cache=index_cache_dir(config),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=create_attention_mask,
    )


def _restrict_splits(
    dataset_config: GPTDatasetConfig,
    sizes: list[int],
    prefixes: dict[str, PrefixSize],
    split: str,
    seq_length: int,
) -> None:
    """Skip splits nobody asked samples of, and refuse splits asked of that hold no data
    (or less than one sample of it: every sample would repeat the split's text).

    Megatron builds every split with a share in ``data.split`` and loops forever on a split
    without documents, so its split matrix is edited (its bookends stay where they are, so
    the other splits keep exactly the same documents)."""
    check_splits(prefixes, split, sizes, dataset_config.split_matrix, seq_length)
    for i, _ in enumerate(Split):
        if sizes[i] == 0:
            dataset_config.split_matrix[i] = None


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
    prefixes = check_data_config(config)
    tokenizer = check_tokenizer(config)
    sizes = [train_samples, valid_samples, test_samples]
    dataset_class = MockGPTDataset if config.data.mock else GPTDataset
    weights = config.data.weights
    if weights is None and len(prefixes) > 1:
        # "proportional to size" as explicit weights: Megatron then draws as many samples as
        # asked (repeating epochs); without weights it stops after one pass over each prefix
        weights = [float(size.tokens) for size in prefixes.values()]
    dataset_config = gpt_dataset_config(config, tokenizer, create_attention_mask, weights)
    _restrict_splits(dataset_config, sizes, prefixes, config.data.split, config.model.seq_length)
    builder = BlendedMegatronDatasetBuilder(
        dataset_class, sizes, is_built_on_rank or (lambda: True), dataset_config
    )
    with megatron_state.blended_dataset_outside_a_group():
        train, valid, test = builder.build()
    return train, valid, test


def blend_counts(dataset: Any) -> np.ndarray:
    """How many samples a ``BlendedDataset`` draws from each of its datasets."""
    return np.bincount(np.asarray(dataset.dataset_index), minlength=len(dataset.datasets))
