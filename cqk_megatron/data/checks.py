"""Everything about a run's data that can be checked from files, without torch or Megatron:
the launcher runs these before it queues a job, ``build_datasets`` before it builds one.

- a prefix names a ``.bin``/``.idx`` pair that exists, whose index reads (Megatron's
  ``MMIDIDX`` format, version 1, read here with numpy: the header, sequence lengths and
  pointers), and whose ``.bin`` size is what the index describes;
- the index describes one contiguous ``.bin``: each document starts where the one before
  it ends, and the last ends where the ``.bin`` does;
- the index belongs to this ``.bin``: the counts (and, for datasets written since it was
  recorded, the ``.idx`` file's sha256) match ``P.meta.json``, and sampled documents end
  with the EOD id where the index says they end (cqk data preprocess appends one to each).
  Without a ``P.meta.json`` the tokenizer's EOD is used, for a dataset whose last token is
  EOD (one written with an EOD after each document);
- the tokenizer fits ``model.vocab_size`` and is the one the data was made with;
- every split that is asked for samples holds documents, and at least one sample's worth
  of tokens (``model.seq_length + 1``), so that no sample repeats the corpus.
"""

from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cqk_megatron.config import ConfigError, RunConfig
from cqk_megatron.data.errors import DataError
from cqk_megatron.data.metadata import bin_path, idx_path, meta_path, read_meta
from cqk_megatron.data.tokenizer import (
    IdsOnlyTokenizer,
    Tokenizer,
    check_vocab_fits,
    load_tokenizer,
)
from cqk_megatron.run.file_hash import file_sha256

_INDEX_HEADER = b"MMIDIDX\x00\x00"  # megatron.core.datasets.indexed_dataset's
_DTYPES = {  # megatron.core.datasets.indexed_dataset.DType codes
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_MAKE_IT = "make it with cqk data preprocess (or cqk data demo-corpus)"
_REMAKE = "re-run cqk data preprocess --force for it"
_SPLIT = re.compile(r"^\s*\d+(\.\d*)?(\s*,\s*\d+(\.\d*)?){0,2}\s*$")
SPLIT_NAMES = ("train", "valid", "test")
EOD_SAMPLES = 256  # documents whose last token is compared with EOD


@dataclass(frozen=True)
class PrefixSize:
    sequences: int  # one per document as cqk data preprocess writes them
    tokens: int
    lengths: np.ndarray | None = None  # tokens per sequence (for split sizes)


@dataclass
class Index:
    dtype: np.dtype
    lengths: np.ndarray  # int32, tokens per sequence
    pointers: np.ndarray  # int64, byte offset of each sequence in the .bin


def read_index(prefix: str) -> Index:
    """The sequence table of ``P.idx``; ``DataError`` if it is not a readable index."""
    path = idx_path(prefix)
    problem = f"dataset '{prefix}': {path} is not a readable Megatron index"
    try:
        with open(path, "rb") as stream:
            if stream.read(9) != _INDEX_HEADER:
                raise DataError(f"{problem} (wrong header); {_REMAKE}")
            (version,) = struct.unpack("<Q", stream.read(8))
            (code,) = struct.unpack("<B", stream.read(1))
            sequences, _documents = struct.unpack("<QQ", stream.read(16))
            offset = stream.tell()
        if version != 1 or code not in _DTYPES:
            raise DataError(f"{problem} (version {version}, dtype code {code}); {_REMAKE}")
        size = path.stat().st_size
        if offset + sequences * 12 > size:
            raise DataError(f"{problem} (cut short: {size} bytes); {_REMAKE}")
        lengths = np.fromfile(path, dtype=np.int32, count=sequences, offset=offset)
        pointers = np.fromfile(
            path, dtype=np.int64, count=sequences, offset=offset + lengths.nbytes
        )
    except (OSError, struct.error) as error:
        raise DataError(f"{problem} ({error}); {_REMAKE}") from error
    return Index(np.dtype(_DTYPES[code]), lengths, pointers)


def index_fingerprint(prefix: str | Path) -> str:
    """sha256 of ``P.idx``: cqk data preprocess records it in ``P.meta.json``."""
    return file_sha256(idx_path(prefix))


def _not_the_index(prefix: str) -> str:
    return (
        f"{idx_path(prefix)} does not belong to {bin_path(prefix)} (an index from another "
        f"dataset of the same size?); {_REMAKE}"
    )


def _check_belongs(prefix: str, index: Index, meta: dict | None) -> None:
    """The index describes this dataset's documents, not another's of the same size."""
    if meta is None:
        return  # check_ends_without_meta, once the tokenizer is known
    idx_file = idx_path(prefix)
    another = _not_the_index(prefix)
    recorded = meta.get("idx_sha256")
    if recorded is not None and recorded != index_fingerprint(prefix):
        raise DataError(
            f"dataset '{prefix}': {idx_file} is not the index {meta_path(prefix).name} "
            f"recorded (sha256 differs): {another}"
        )
    counts = (meta.get("documents"), meta.get("tokens"))
    ours = (len(index.lengths), int(index.lengths.sum(dtype=np.int64)))
    if None not in counts and tuple(int(c) for c in counts) != ours:
        raise DataError(
            f"dataset '{prefix}': {idx_file} lists {ours[0]} documents and {ours[1]} tokens, "
            f"{meta_path(prefix).name} {counts[0]} and {counts[1]}: {another}"
        )
    eod = meta.get("tokenizer", {}).get("eod")
    if meta.get("eod_appended") and eod is not None:
        _check_document_ends(
            prefix, index, int(eod), "as every document cqk data preprocess writes"
        )


def _check_document_ends(prefix: str, index: Index, eod: int, why: str) -> None:
    """Sampled documents end with ``eod`` where the index says they end."""
    if len(index.lengths) == 0:
        return
    picks = np.unique(np.linspace(0, len(index.lengths) - 1, EOD_SAMPLES).astype(np.int64))
    tokens = np.memmap(bin_path(prefix), dtype=index.dtype, mode="r")
    size = index.dtype.itemsize
    last = (index.pointers[picks] // size) + index.lengths[picks].astype(np.int64) - 1
    wrong = picks[tokens[last] != eod]
    if len(wrong):
        raise DataError(
            f"dataset '{prefix}': document {int(wrong[0])} (of {len(index.lengths)}) does not "
            f"end with the EOD id {eod} where {idx_path(prefix)} says it ends, {why} does: "
            f"{_not_the_index(prefix)}"
        )


def check_ends_without_meta(prefix: str, eod: int) -> None:
    """For a dataset without ``P.meta.json`` (made by another tool, or its meta file lost):
    if its last token is ``eod`` (an EOD after each document), sampled documents end with
    it where the index says; an index of another dataset of the same size does not."""
    _check_ends_without_meta(prefix, eod, _stamp(prefix))


@functools.lru_cache(maxsize=64)
def _check_ends_without_meta(prefix: str, eod: int, stamp: tuple | None) -> None:
    index = read_index(prefix)
    if len(index.lengths) == 0 or read_meta(prefix) is not None:
        return
    tokens = np.memmap(bin_path(prefix), dtype=index.dtype, mode="r")
    if len(tokens) and int(tokens[-1]) == eod:
        meta = meta_path(prefix).name
        why = f"as every document of a dataset that ends with EOD (it has no {meta})"
        _check_document_ends(prefix, index, eod, why)


def _check_contiguous(prefix: str, index: Index) -> None:
    """Each document starts where the one before ends (Megatron's writers lay them out so),
    so every offset lies within the ``.bin`` whose size the caller checked."""
    lengths, pointers = index.lengths, index.pointers
    ends = pointers[:-1] + lengths[:-1].astype(np.int64) * index.dtype.itemsize
    starts_ok = np.concatenate(([pointers[0] == 0], pointers[1:] == ends))
    bad = np.flatnonzero(~starts_ok | (lengths < 0))
    if len(bad):
        first = int(bad[0])
        raise DataError(
            f"dataset '{prefix}': {idx_path(prefix)} places document {first} (of "
            f"{len(lengths)}) at byte {int(pointers[first])} with {int(lengths[first])} "
            "tokens, not right after the document before it: not a readable index of "
            f"{bin_path(prefix)}; {_REMAKE}"
        )


def check_prefix(prefix: str) -> PrefixSize:
    """The .bin/.idx pair exists and belongs together; its size. A sweep checks the same
    prefix for each of its runs: files unchanged since the last check are not read again."""
    return _check_prefix(prefix, _stamp(prefix))


def _stamp(prefix: str) -> tuple | None:
    """Sizes and times of the dataset's files: a cached check holds while they are equal."""
    try:
        return tuple(
            (p.stat().st_size, p.stat().st_mtime_ns)
            for p in (bin_path(prefix), idx_path(prefix), meta_path(prefix))
            if p.exists()
        )
    except OSError:
        return None


@functools.lru_cache(maxsize=64)
def _check_prefix(prefix: str, stamp: tuple | None) -> PrefixSize:
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
                f"{_REMAKE}"
            )
    index = read_index(prefix)
    lengths, pointers = index.lengths, index.pointers
    expected = (
        0 if len(lengths) == 0 else int(pointers[-1]) + int(lengths[-1]) * index.dtype.itemsize
    )
    actual = bin_file.stat().st_size
    if actual != expected:
        raise DataError(
            f"dataset '{prefix}': {bin_file} has {actual} bytes but {idx_file} describes "
            f"{expected}; the two files do not belong together (interrupted copy?); {_REMAKE}"
        )
    if len(lengths) == 0:
        raise DataError(f"dataset '{prefix}' holds no documents; {_MAKE_IT} from non-empty input")
    _check_contiguous(prefix, index)
    _check_belongs(prefix, index, read_meta(prefix))
    return PrefixSize(len(lengths), int(lengths.sum(dtype=np.int64)), lengths)


# -- tokenizer ---------------------------------------------------------------------------------


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


def check_meta_agrees(prefix: str, tokenizer: Tokenizer, config: RunConfig) -> None:
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
            "re-run cqk data preprocess with this one"
        )
    max_id = meta.get("max_token_id")
    if max_id is not None and int(max_id) >= config.model.vocab_size:
        raise ConfigError(
            f"dataset '{prefix}' holds token id {max_id} but model.vocab_size="
            f"{config.model.vocab_size}; set model.vocab_size={int(recorded['vocab_size'])}"
        )


# -- splits ---------------------------------------------------------------------------------


def check_split(split: str) -> None:
    if not _SPLIT.match(split) or sum(float(x) for x in split.split(",")) <= 0:
        raise ConfigError(
            f"data.split={split!r} must be one to three comma-separated non-negative "
            "train,valid,test weights with a positive sum, e.g. '969,30,1'"
        )


def split_matrix(split: str) -> list[tuple[float, float] | None]:
    """Megatron's split matrix for ``split`` (``parse_and_normalize_split`` then
    ``convert_split_vector_to_split_matrix`` of ``blended_megatron_dataset_config``)."""
    weights = [float(x) for x in re.findall(r"[.0-9]+", split)]
    weights += [0.0] * (len(SPLIT_NAMES) - len(weights))
    total = sum(weights)
    vector = [w / total for w in weights]
    ends = functools.reduce(lambda a, b: a + [a[-1] + b], [[0], *vector])
    return [(b, e) if e > b else None for b, e in zip(ends[:-1], ends[1:], strict=True)]


def split_range(bookends: tuple[float, float], count: int) -> tuple[int, int]:
    """The documents ``[begin, end)`` of a split, as Megatron's builder rounds them."""
    return int(round(bookends[0] * float(count))), int(round(bookends[1] * float(count)))


def _unit_hint(prefix: str, documents: int) -> str:
    """Which text-unit option would cut the corpus into more documents, if any."""
    try:
        meta = read_meta(prefix) or {}
    except DataError:
        return ""
    unit = meta.get("text_unit")
    text_inputs = any(i.get("format") == "text" for i in meta.get("inputs", []))
    if not text_inputs or unit == "line":
        return ""
    return (
        f"; it was tokenized with --text-unit {unit}, which made {documents} document(s) of "
        "its text: if the text holds one document per line, re-run cqk data preprocess (or "
        "cqk repro) with --text-unit line"
    )


def check_splits(
    prefixes: dict[str, PrefixSize],
    split: str,
    samples: list[int],
    matrix: list[tuple[float, float] | None] | None = None,
    seq_length: int | None = None,
) -> None:
    """Every split asked for samples has a share, documents, and (with ``seq_length``) at
    least one sample of tokens in every prefix. ``matrix``: Megatron's, when at hand."""
    matrix = split_matrix(split) if matrix is None else matrix
    for i, name in enumerate(SPLIT_NAMES):
        if samples[i] < 0:
            raise ConfigError(f"{name} samples must be >= 0, got {samples[i]}")
        if samples[i] == 0:
            continue
        if matrix[i] is None:
            raise ConfigError(
                f"{samples[i]} {name} samples asked for, but data.split={split!r} gives the "
                f"{name} split no share; give it one (e.g. '969,30,1') or ask for 0"
            )
        for prefix, size in prefixes.items():
            begin, end = split_range(matrix[i], size.sequences)
            if end - begin == 0:
                raise DataError(
                    f"data.split={split!r} gives the {name} split 0 of the {size.sequences} "
                    f"documents in '{prefix}'{_unit_hint(prefix, size.sequences)}; else give "
                    f"that split a larger share, use more data, or ask for 0 {name} samples"
                )
            if seq_length is None or size.lengths is None:
                continue
            tokens = int(size.lengths[begin:end].sum(dtype=np.int64))
            if tokens < seq_length + 1:
                raise DataError(
                    f"the {name} split of '{prefix}' holds {tokens} tokens "
                    f"({end - begin} documents), fewer than one sample of model.seq_length="
                    f"{seq_length} needs ({seq_length + 1}): every sample would repeat that "
                    f"text; use more data, a larger {name} share of data.split, or "
                    f"model.seq_length <= {max(tokens - 1, 1)}"
                )


# -- all of it --------------------------------------------------------------------------------


def check_data_config(config: RunConfig) -> dict[str, PrefixSize]:
    """The size of each prefix, after checking everything about them but the splits."""
    data = config.data
    check_split(data.split)
    if data.mock:
        return {}
    if not data.prefixes:
        raise ConfigError(
            "data.prefixes is empty: list dataset prefixes (e.g. data/demo/demo_text_document "
            "from cqk data demo-corpus), or set data.mock=true for synthetic tokens"
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


def check_tokenizer(config: RunConfig) -> Tokenizer:
    tokenizer = resolve_tokenizer(config)
    check_vocab_fits(tokenizer, config)
    if not config.data.mock:
        for prefix in config.data.prefixes:
            check_meta_agrees(prefix, tokenizer, config)
            check_ends_without_meta(prefix, tokenizer.eod)
    return tokenizer


def run_samples(config: RunConfig) -> list[int]:
    """(train, valid, test) samples the training loop asks ``build_datasets`` for."""
    t = config.train
    evaluations = t.train_steps // t.eval_interval + 1
    return [
        t.train_steps * t.global_batch_size,
        evaluations * t.eval_iters * t.global_batch_size,
        0,
    ]


def check_run_data(config: RunConfig) -> None:
    """Everything the training run's data needs, from files (the launcher's pre-flight)."""
    prefixes = check_data_config(config)
    check_tokenizer(config)
    if prefixes:
        check_splits(
            prefixes, config.data.split, run_samples(config), seq_length=config.model.seq_length
        )
