"""Statistics of indexed datasets: documents, tokens, document lengths, the most frequent
tokens (with their pieces when the tokenizer is at hand) and what the metadata records.

    cqk data stats data/demo/demo_text_document --top-k 20
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cqk_megatron.cli.args import new_parser
from cqk_megatron.data.errors import DataError
from cqk_megatron.data.metadata import bin_path, read_meta
from cqk_megatron.data.tokenizer import Tokenizer, load_tokenizer
from data_tools.cli import friendly_errors

_CHUNK_TOKENS = 1 << 25


@dataclass
class TokenCount:
    id: int
    count: int
    share: float
    piece: str | None = None


@dataclass
class DatasetStats:
    prefix: str
    documents: int
    tokens: int
    dtype: str
    bin_bytes: int
    mean_length: float
    median_length: float
    min_length: int
    max_length: int
    p90_length: float
    distinct_tokens: int
    max_token_id: int
    eod_id: int | None
    eod_count: int | None
    top: list[TokenCount] = field(default_factory=list)
    meta: dict[str, Any] | None = None


def _token_counts(prefix: str, dtype: np.dtype) -> np.ndarray:
    """Counts of every id over the whole ``.bin``, read in chunks (memory stays bounded)."""
    data = np.memmap(bin_path(prefix), dtype=dtype, mode="r")
    counts = np.zeros(1, dtype=np.int64)
    for start in range(0, len(data), _CHUNK_TOKENS):
        chunk = np.bincount(np.asarray(data[start : start + _CHUNK_TOKENS]))
        if len(chunk) > len(counts):
            counts = np.pad(counts, (0, len(chunk) - len(counts)))
        counts[: len(chunk)] += chunk
    return counts


def dataset_stats(prefix: str, top_k: int = 20, tokenizer: Tokenizer | None = None) -> DatasetStats:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from cqk_megatron.data.checks import check_prefix

    check_prefix(prefix)
    index = IndexedDataset(prefix)
    # one sequence per document as cqk data preprocess writes it; otherwise sum each document's
    lengths = np.add.reduceat(
        index.sequence_lengths.astype(np.int64), index.document_indices[:-1].astype(np.int64)
    )
    counts = _token_counts(prefix, index.index.dtype)
    total = int(counts.sum())
    meta = read_meta(prefix)
    eod = None
    if meta is not None:
        eod = int(meta["tokenizer"]["eod"])
    elif tokenizer is not None:
        eod = tokenizer.eod
    order = np.argsort(-counts, kind="stable")[: max(top_k, 0)]
    order = order[counts[order] > 0]
    pieces = tokenizer.pieces(order.tolist()) if tokenizer is not None else [None] * len(order)
    top = [
        TokenCount(int(i), int(counts[i]), float(counts[i] / total), piece)
        for i, piece in zip(order, pieces, strict=True)
    ]
    return DatasetStats(
        prefix=prefix,
        documents=len(lengths),
        tokens=total,
        dtype=np.dtype(index.index.dtype).name,
        bin_bytes=bin_path(prefix).stat().st_size,
        mean_length=float(lengths.mean()),
        median_length=float(np.median(lengths)),
        min_length=int(lengths.min()),
        max_length=int(lengths.max()),
        p90_length=float(np.percentile(lengths, 90)),
        distinct_tokens=int((counts > 0).sum()),
        max_token_id=int(np.flatnonzero(counts)[-1]),
        eod_id=eod,
        eod_count=None if eod is None or eod >= len(counts) else int(counts[eod]),
        top=top,
        meta=meta,
    )


def format_stats(stats: DatasetStats) -> str:
    lines = [
        f"dataset         {stats.prefix}",
        f"documents       {stats.documents:,}",
        f"tokens          {stats.tokens:,}  ({stats.dtype}, {stats.bin_bytes / 1e6:,.2f} MB)",
        f"doc length      mean {stats.mean_length:,.1f}  median {stats.median_length:,.0f}  "
        f"p90 {stats.p90_length:,.0f}  min {stats.min_length:,}  max {stats.max_length:,}",
        f"distinct ids    {stats.distinct_tokens:,}  (max id {stats.max_token_id:,})",
    ]
    if stats.eod_id is not None:
        lines.append(
            f"EOD id {stats.eod_id:<8} {stats.eod_count:,} occurrences "
            f"({'one per document' if stats.eod_count == stats.documents else 'check the data'})"
        )
    meta = stats.meta
    if meta is not None:
        tok = meta["tokenizer"]
        lines.append(
            f"tokenizer       {tok.get('path')} ({tok.get('kind')}, vocab {tok['vocab_size']:,})"
        )
        if meta.get("bytes"):
            lines.append(
                f"source text     {meta['bytes'] / 1e6:,.2f} MB from {len(meta.get('inputs', []))} "
                f"input(s), {meta['bytes'] / max(stats.tokens, 1):.2f} bytes/token"
            )
    if stats.top:
        lines.append(f"top {len(stats.top)} tokens:")
        for rank, token in enumerate(stats.top, 1):
            piece = "" if token.piece is None else f"  {token.piece!r}"
            share = f"{100 * token.share:6.2f}%"
            lines.append(f"  {rank:>3}. id {token.id:<7} {token.count:>12,}  {share}{piece}")
    return "\n".join(lines)


def _tokenizer_for(prefix: str, explicit: str | None) -> Tokenizer | None:
    if explicit:
        return load_tokenizer(explicit)
    meta = read_meta(prefix)
    path = meta["tokenizer"].get("path") if meta else None
    return load_tokenizer(path) if path and Path(path).exists() else None


@friendly_errors
def main(argv: list[str] | None = None) -> int:
    parser = new_parser("cqk data stats", __doc__.split("\n\n")[0])
    parser.add_argument("prefixes", nargs="+", help="dataset prefixes (without .bin/.idx)")
    parser.add_argument("--top-k", type=int, default=20, help="most frequent tokens to show")
    parser.add_argument("--tokenizer", help="decode top tokens (default: from the metadata)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    results = []
    for prefix in args.prefixes:
        if prefix.endswith((".bin", ".idx")):
            raise DataError(f"give the prefix without .bin/.idx: '{prefix[:-4]}'")
        stats = dataset_stats(prefix, args.top_k, _tokenizer_for(prefix, args.tokenizer))
        results.append(stats)
        if not args.json:
            print(format_stats(stats) + "\n")
    if args.json:
        print(json.dumps([asdict(s) for s in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
