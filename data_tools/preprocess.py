"""Tokenize corpora into a Megatron indexed dataset (``PREFIX.bin``/``PREFIX.idx``).

Every document gets the tokenizer's EOD id appended and becomes one sequence, as Megatron-
LM's own ``tools/preprocess_data.py --append-eod`` writes it. Tokenization runs in worker
processes (all available cores by default) fed in document order, while this process
writes with Megatron's ``IndexedDatasetBuilder``. Output goes to a hidden temporary folder
beside the prefix and is renamed into place at the end (index last), with
``PREFIX.meta.json`` recording the tokenizer and counts.

    cqk data preprocess --input corpus.jsonl --tokenizer spm.model \\
        --out data/corpus_text_document
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import multiprocessing
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cqk_megatron.cli.args import add_force, add_out, new_parser
from cqk_megatron.config import load_config
from cqk_megatron.data.checks import index_fingerprint
from cqk_megatron.data.errors import DataError
from cqk_megatron.data.metadata import bin_path, idx_path, meta_path, write_json
from cqk_megatron.data.tokenizer import Tokenizer, check_vocab_fits, load_tokenizer
from data_tools.cli import friendly_errors
from data_tools.outputs import commit_dataset, partial_paths, refuse_existing_dataset
from data_tools.progress import Progress
from data_tools.sources import (
    MAX_INVALID_UTF8,
    FileReport,
    add_input_arguments,
    default_workers,
    open_corpus,
)


@dataclass
class PreprocessResult:
    prefix: str
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    skipped_empty: int = 0
    max_token_id: int = -1
    seconds: float = 0.0
    inputs: list[FileReport] = field(default_factory=list)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's ``DType.optimal_dtype``: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


# --------------------------------------------------------------------------------------
# worker side: tokenizer only (no torch, no Megatron)
# --------------------------------------------------------------------------------------

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer_path)


@dataclass
class EncodedBatch:
    lengths: np.ndarray  # tokens per kept document, EOD included
    tokens: np.ndarray  # all kept documents, concatenated
    bytes: int  # UTF-8 size of every document in the batch, kept or not
    documents: int  # documents in the batch, kept or not
    skipped: int  # empty or whitespace-only documents (not written)


def encode_batch(texts: list[str | None], tokenizer: Tokenizer | None = None) -> EncodedBatch:
    tokenizer = tokenizer or _worker_tokenizer
    assert tokenizer is not None, "worker started without its tokenizer"
    dtype = token_dtype(tokenizer.vocab_size)
    nbytes = sum(len(t.encode("utf-8")) for t in texts if t)
    kept = [t for t in texts if t and not t.isspace()]
    ids = tokenizer.tokenize_batch(kept) if kept else []
    sizes = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    total = int(sizes.sum())
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=total)
    # EOD after each document: insert at each document's end offset
    flat = np.insert(flat, np.cumsum(sizes), tokenizer.eod).astype(dtype, copy=False)
    return EncodedBatch(sizes + 1, flat, nbytes, len(texts), len(texts) - len(kept))


def _encode_in_worker(texts: list[str | None]) -> EncodedBatch:
    return encode_batch(texts)


def _batches(dataset: Any, docs_per_task: int) -> Iterator[list[str | None]]:
    for batch in dataset.iter(batch_size=docs_per_task):
        yield batch["text"]


def _encoded(
    dataset: Any, tokenizer: Tokenizer, tokenizer_path: str, workers: int, docs_per_task: int
) -> Iterator[EncodedBatch]:
    """Encoded batches in document order, from a pool of workers (or this process)."""
    batches = _batches(dataset, docs_per_task)
    if workers <= 1:
        yield from (encode_batch(texts, tokenizer) for texts in batches)
        return
    # fork: the workers need only the tokenizer, loaded fresh in each; spawn where fork is
    # unavailable (it re-imports the main module, which is slower but equivalent)
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    context = multiprocessing.get_context(method)
    with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path,)) as pool:
        # imap keeps document order; its feeder blocks on a full pipe, so a large corpus is
        # never read into memory ahead of the workers
        yield from pool.imap(_encode_in_worker, batches)


# --------------------------------------------------------------------------------------
# main side
# --------------------------------------------------------------------------------------


def _check_prefix_name(prefix: Path) -> None:
    if prefix.suffix in (".bin", ".idx"):
        raise DataError(
            f"--out '{prefix}' ends in {prefix.suffix}; give the prefix without it: "
            f"'{prefix.with_suffix('')}'"
        )
    if prefix.is_dir():
        raise DataError(
            f"--out '{prefix}' is a folder; give a file prefix inside it, e.g. "
            f"'{prefix / 'corpus_text_document'}'"
        )


def write_indexed_dataset(
    partial_prefix: Path, encoded: Iterable[EncodedBatch], dtype: np.dtype, progress: Progress
) -> PreprocessResult:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    result = PreprocessResult(prefix=str(partial_prefix))
    builder = IndexedDatasetBuilder(str(bin_path(partial_prefix)), dtype=dtype.type)
    for batch in encoded:
        offsets = np.concatenate([[0], np.cumsum(batch.lengths)])
        for start, end in itertools.pairwise(offsets):
            builder.add_document(batch.tokens[start:end], [int(end - start)])
        kept = len(batch.lengths)
        result.documents += kept
        result.tokens += int(batch.lengths.sum())
        result.bytes += batch.bytes
        result.skipped_empty += batch.skipped
        if len(batch.tokens):
            result.max_token_id = max(result.max_token_id, int(batch.tokens.max()))
        progress.update(batch.documents, batch.bytes, int(batch.lengths.sum()))
    builder.finalize(str(idx_path(partial_prefix)))
    return result


def _verify(partial_prefix: Path, result: PreprocessResult) -> None:
    """Read the new index back through Megatron before it is put in place."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    index = IndexedDataset(str(partial_prefix))
    documents = len(index.document_indices) - 1
    tokens = int(index.sequence_lengths.sum(dtype=np.int64))
    if (documents, tokens) != (result.documents, result.tokens):
        raise DataError(
            f"internal check failed for {partial_prefix}: index has {documents} documents and "
            f"{tokens} tokens, the writer counted {result.documents} and {result.tokens}"
        )


def preprocess(
    inputs: list[str],
    output_prefix: str | Path,
    tokenizer_path: str | Path,
    *,
    text_field: str = "text",
    text_unit: str = "paragraph",
    input_format: str | None = None,
    split: str = "train",
    skip_missing_text: bool = False,
    max_invalid_utf8: float = MAX_INVALID_UTF8,
    workers: int | None = None,
    docs_per_task: int = 256,
    overwrite: bool = False,
    progress: bool = True,
    command: list[str] | None = None,
) -> PreprocessResult:
    """Tokenize ``inputs`` into ``output_prefix``.bin/.idx (+ .meta.json); see the module doc."""
    prefix = Path(output_prefix).expanduser()
    _check_prefix_name(prefix)
    refuse_existing_dataset(prefix, overwrite)
    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer_path = str(Path(tokenizer_path).expanduser().resolve())
    workers = workers or default_workers()
    from megatron.core.datasets import indexed_dataset  # noqa: F401 - slow import, not timed

    start = time.perf_counter()
    log = (lambda message: print(message, file=sys.stderr)) if progress else (lambda m: None)

    with partial_paths(prefix) as (work,):
        corpus = open_corpus(
            inputs,
            work,
            text_field=text_field,
            text_unit=text_unit,
            input_format=input_format,
            split=split,
            report=lambda message: print(message, file=sys.stderr),
            skip_missing_text=skip_missing_text,
            max_invalid_utf8=max_invalid_utf8,
        )
        log(
            f"tokenizing {len(corpus):,} documents from {len(corpus.files)} input(s) with "
            f"{tokenizer} on {workers} worker(s)"
        )
        dtype = token_dtype(tokenizer.vocab_size)
        # several tasks per worker even for few, long documents, or one worker idles
        docs_per_task = max(1, min(docs_per_task, math.ceil(len(corpus) / (workers * 8))))
        bar = Progress(len(corpus), "preprocess", enabled=progress)
        partial_prefix = work / "dataset"
        encoded = _encoded(corpus.dataset, tokenizer, tokenizer_path, workers, docs_per_task)
        result = write_indexed_dataset(partial_prefix, encoded, dtype, bar)
        bar.close()
        if result.documents == 0:
            raise DataError(
                f"no documents with text in {', '.join(inputs)}: all {result.skipped_empty} were "
                "empty; check --text-field / --text-unit"
            )
        _verify(partial_prefix, result)
        result.seconds = time.perf_counter() - start
        result.prefix = str(prefix)
        result.inputs = corpus.files
        write_json(
            meta_path(partial_prefix),
            _metadata(
                result,
                tokenizer,
                tokenizer_path,
                dtype,
                text_field,
                text_unit,
                command,
                index_fingerprint(partial_prefix),
            ),
        )
        commit_dataset(partial_prefix, prefix)
    if result.skipped_empty:
        print(f"note: skipped {result.skipped_empty} empty document(s)", file=sys.stderr)
    return result


def _metadata(
    result: PreprocessResult,
    tokenizer: Tokenizer,
    tokenizer_path: str,
    dtype: np.dtype,
    text_field: str,
    text_unit: str,
    command: list[str] | None,
    idx_sha256: str,
) -> dict[str, Any]:
    described = tokenizer.describe() | {"path": tokenizer_path}
    return {
        "format": "megatron-indexed-dataset",
        "prefix": Path(result.prefix).name,
        "tokenizer": described,
        "dtype": dtype.name,
        "documents": result.documents,
        # training checks that the .idx beside the .bin is this one (cqk_megatron.data.checks)
        "idx_sha256": idx_sha256,
        "tokens": result.tokens,
        "bytes": result.bytes,
        "max_token_id": result.max_token_id,
        "eod_appended": True,
        "skipped_empty_documents": result.skipped_empty,
        "replaced_invalid_utf8": sum(f.replaced_bytes for f in result.inputs),
        "text_field": text_field,
        "text_unit": text_unit,
        "inputs": [asdict(f) for f in result.inputs],
        "seconds": round(result.seconds, 3),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "cqk data preprocess", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1]
    )
    add_input_arguments(parser)
    add_out(
        parser,
        "prefix of the dataset to write: PREFIX.bin/.idx/.meta.json",
        old=("--output-prefix",),
        required=True,
    )
    parser.add_argument("--tokenizer", required=True, help="SentencePiece .model or HF folder")
    parser.add_argument(
        "--workers", type=int, default=default_workers(), help="tokenizing processes"
    )
    parser.add_argument(
        "--docs-per-task", type=int, default=256, help="documents sent to a worker at a time"
    )
    add_force(parser, "replace an existing dataset at --out")
    parser.add_argument(
        "--config", help="a run config: check the tokenizer fits its model.vocab_size first"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


@friendly_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.config:
        check_vocab_fits(load_tokenizer(args.tokenizer), load_config(args.config))
    result = preprocess(
        args.input,
        args.out,
        args.tokenizer,
        text_field=args.text_field,
        text_unit=args.text_unit,
        input_format=args.input_format,
        split=args.split,
        skip_missing_text=args.skip_missing_text,
        max_invalid_utf8=args.max_invalid_utf8,
        workers=args.workers,
        docs_per_task=args.docs_per_task,
        overwrite=args.force,
        progress=not args.quiet,
        command=sys.argv if argv is None else ["cqk", "data", "preprocess", *argv],
    )
    print(
        f"wrote {result.prefix}.bin/.idx: {result.documents:,} documents, {result.tokens:,} "
        f"tokens ({result.mb_per_s:.2f} MB/s, {result.tokens_per_s:,.0f} tokens/s overall)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
