"""Train a SentencePiece tokenizer (BPE or unigram) on text, JSONL, Parquet or a saved
``datasets`` folder; writes ``PREFIX.model``, ``PREFIX.vocab`` and ``PREFIX.recipe.json``
(how it was made: options, inputs, sampled documents, versions).

Defaults suit language-model pretraining on text and code: byte fallback (no unknown
tokens), NFKC normalisation that keeps whitespace (indentation and newlines survive),
digits split, ids unk=0, bos=1, eos=2 (EOD), pad=3.

    cqk data tokenizer --input corpus.jsonl --out out/spm \\
        --vocab-size 8192 --model-type bpe
"""

from __future__ import annotations

import argparse
import datetime
import io
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cqk_megatron.cli.args import add_force, add_out, new_parser
from cqk_megatron.data.errors import DataError
from cqk_megatron.data.metadata import write_json
from data_tools.cli import friendly_errors
from data_tools.outputs import (
    commit_file,
    partial_paths,
    refuse_existing_file,
    refuse_foreign_output,
)
from data_tools.sources import MAX_INVALID_UTF8, add_input_arguments, default_workers, open_corpus

NORMALIZATIONS = ("nfkc", "identity", "nmt_nfkc", "nfkc_cf", "nmt_nfkc_cf")
# SentencePiece skips training sentences longer than its max_sentence_length (bytes);
# long lines are cut into pieces below that instead of being dropped.
_MAX_SENTENCE_BYTES = 16384
_LINE_PIECE_CHARS = 4096


@dataclass
class TokenizerRecipe:
    model_type: str = "bpe"  # bpe | unigram
    vocab_size: int = 32000
    character_coverage: float = 0.9995
    byte_fallback: bool = True
    normalization: str = "nfkc"
    remove_extra_whitespaces: bool = False
    split_digits: bool = True
    sample_documents: int = 100_000  # documents drawn (uniformly, seeded) for training
    seed: int = 1234
    unk_id: int = 0
    bos_id: int = 1  # -1: none
    eos_id: int = 2  # the end-of-document id appended by preprocessing
    pad_id: int = 3  # -1: none
    user_defined_symbols: list[str] = field(default_factory=list)
    threads: int = field(default_factory=default_workers)

    def check(self) -> None:
        if self.model_type not in ("bpe", "unigram"):
            raise DataError(f"--model-type {self.model_type!r} is unknown; choose bpe or unigram")
        if self.normalization not in NORMALIZATIONS:
            raise DataError(
                f"--normalization {self.normalization!r} is unknown; choose one of "
                f"{list(NORMALIZATIONS)}"
            )
        if not 0 < self.character_coverage <= 1:
            raise DataError("--character-coverage must be in (0, 1], e.g. 0.9995 (1.0 for code)")
        if self.eos_id < 0:
            raise DataError("--eos-id must be >= 0: preprocessing appends it to every document")
        specials = [i for i in (self.unk_id, self.bos_id, self.eos_id, self.pad_id) if i >= 0]
        if len(set(specials)) != len(specials):
            raise DataError(f"special ids unk/bos/eos/pad={specials} must be distinct")
        floor = len(specials) + (256 if self.byte_fallback else 0) + len(self.user_defined_symbols)
        if self.vocab_size <= floor:
            raise DataError(
                f"--vocab-size {self.vocab_size} leaves no room for learned pieces: special ids"
                + (" and 256 byte pieces" if self.byte_fallback else "")
                + f" take {floor}; use a larger --vocab-size"
            )
        if self.sample_documents < 1:
            raise DataError("--sample-documents must be at least 1")


@dataclass
class TrainedTokenizer:
    model: Path
    recipe_file: Path
    documents_total: int
    documents_sampled: int
    sentences: int
    seconds: float


def _sample(dataset: Any, count: int, seed: int) -> Any:
    if len(dataset) <= count:
        return dataset
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(len(dataset), size=count, replace=False))
    return dataset.select(chosen)


def training_sentences(dataset: Any, counter: list[int]) -> Iterator[str]:
    """Documents as SentencePiece training sentences: non-blank lines, long ones cut."""
    for batch in dataset.iter(batch_size=1000):
        for text in batch["text"]:
            if not text:
                continue
            for line in text.split("\n"):
                if not line.strip():
                    continue
                for start in range(0, len(line), _LINE_PIECE_CHARS):
                    counter[0] += 1
                    yield line[start : start + _LINE_PIECE_CHARS]


def _train(sentences: Iterator[str], recipe: TokenizerRecipe, verbose: bool) -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    options = dict(
        sentence_iterator=sentences,
        model_writer=model,
        model_type=recipe.model_type,
        vocab_size=recipe.vocab_size,
        character_coverage=recipe.character_coverage,
        byte_fallback=recipe.byte_fallback,
        normalization_rule_name=recipe.normalization,
        remove_extra_whitespaces=recipe.remove_extra_whitespaces,
        allow_whitespace_only_pieces=True,
        split_digits=recipe.split_digits,
        unk_id=recipe.unk_id,
        bos_id=recipe.bos_id,
        eos_id=recipe.eos_id,
        pad_id=recipe.pad_id,
        user_defined_symbols=recipe.user_defined_symbols or [],
        max_sentence_length=_MAX_SENTENCE_BYTES,
        num_threads=recipe.threads,
        minloglevel=0 if verbose else 2,
    )
    spm.set_random_generator_seed(recipe.seed)
    try:
        spm.SentencePieceTrainer.train(**options)
    except RuntimeError as error:
        message = str(error)
        if "Vocabulary size" in message or "vocab_size" in message:
            raise DataError(
                f"--vocab-size {recipe.vocab_size} does not fit this corpus ({message.strip()}); "
                "lower --vocab-size or give more text"
            ) from error
        raise DataError(f"SentencePiece training failed: {message.strip()}") from error
    return model.getvalue()


def train_tokenizer(
    inputs: list[str],
    output_prefix: str | Path,
    recipe: TokenizerRecipe | None = None,
    *,
    text_field: str = "text",
    text_unit: str = "paragraph",
    input_format: str | None = None,
    split: str = "train",
    skip_missing_text: bool = False,
    max_invalid_utf8: float = MAX_INVALID_UTF8,
    overwrite: bool = False,
    verbose: bool = False,
    command: list[str] | None = None,
) -> TrainedTokenizer:
    recipe = recipe or TokenizerRecipe()
    recipe.check()
    prefix = Path(output_prefix).expanduser()
    if prefix.suffix == ".model":
        prefix = prefix.with_suffix("")
    finals = [Path(f"{prefix}.model"), Path(f"{prefix}.vocab"), Path(f"{prefix}.recipe.json")]
    for final in finals:
        refuse_existing_file(final, overwrite)
    refuse_foreign_output(finals, finals[2], "cqk data tokenizer")
    start = time.perf_counter()
    with partial_paths(prefix, *finals) as (work, *partials):
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
        sample = _sample(corpus.dataset, recipe.sample_documents, recipe.seed)
        counter = [0]
        print(
            f"training a {recipe.model_type} tokenizer (vocab {recipe.vocab_size}) on "
            f"{len(sample):,} of {len(corpus):,} documents",
            file=sys.stderr,
        )
        model_bytes = _train(training_sentences(sample, counter), recipe, verbose)
        if counter[0] == 0:
            raise DataError(f"no text to train on in {', '.join(inputs)}; check --text-field")
        partials[0].write_bytes(model_bytes)
        partials[1].write_text(_vocab_listing(model_bytes), encoding="utf-8")
        seconds = time.perf_counter() - start
        recipe_record = _recipe_record(
            recipe, corpus, len(sample), counter[0], seconds, finals[0], command
        )
        write_json(partials[2], recipe_record)
        # the .model last: a .model without its .recipe.json would look complete
        commit_file(partials[2], finals[2])
        commit_file(partials[1], finals[1])
        commit_file(partials[0], finals[0])
    return TrainedTokenizer(finals[0], finals[2], len(corpus), len(sample), counter[0], seconds)


def _vocab_listing(model_bytes: bytes) -> str:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    return "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i)}\n" for i in range(sp.get_piece_size()))


def _recipe_record(
    recipe: TokenizerRecipe,
    corpus: Any,
    sampled: int,
    sentences: int,
    seconds: float,
    model: Path,
    command: list[str] | None,
) -> dict[str, Any]:
    import datasets
    import sentencepiece

    return {
        "tokenizer": "sentencepiece",
        "model_file": model.name,
        "recipe": asdict(recipe),
        "inputs": [asdict(f) for f in corpus.files],
        "documents_total": len(corpus),
        "documents_sampled": sampled,
        "training_sentences": sentences,
        "replaced_invalid_utf8": corpus.replaced_bytes,
        "versions": {"sentencepiece": sentencepiece.__version__, "datasets": datasets.__version__},
        "seconds": round(seconds, 3),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


def build_parser() -> argparse.ArgumentParser:
    defaults = TokenizerRecipe()
    parser = new_parser(
        "cqk data tokenizer", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1]
    )
    add_input_arguments(parser)
    add_out(
        parser,
        "prefix of the files to write: PREFIX.model, .vocab and .recipe.json",
        old=("--output-prefix",),
        required=True,
    )
    parser.add_argument(
        "--model-type", default=defaults.model_type, choices=["bpe", "unigram"], help="algorithm"
    )
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size, help="pieces")
    parser.add_argument(
        "--character-coverage",
        type=float,
        default=defaults.character_coverage,
        help="share of the characters the vocabulary covers (1.0 for code)",
    )
    parser.add_argument(
        "--no-byte-fallback", dest="byte_fallback", action="store_false", help="unknown -> <unk>"
    )
    parser.add_argument(
        "--normalization",
        default=defaults.normalization,
        choices=NORMALIZATIONS,
        help="SentencePiece's normalization rule",
    )
    parser.add_argument(
        "--remove-extra-whitespaces",
        action="store_true",
        help="collapse runs of whitespace (loses indentation)",
    )
    parser.add_argument(
        "--no-split-digits",
        dest="split_digits",
        action="store_false",
        help="let pieces span several digits",
    )
    parser.add_argument(
        "--sample-documents",
        type=int,
        default=defaults.sample_documents,
        help="documents drawn (uniformly, seeded) for training",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the sample")
    for name in ("unk", "bos", "eos", "pad"):
        parser.add_argument(
            f"--{name}-id",
            type=int,
            default=getattr(defaults, f"{name}_id"),
            help=f"id of <{name}>" + ("" if name in ("unk", "eos") else " (-1: none)"),
        )
    parser.add_argument(
        "--user-defined-symbols", nargs="*", default=[], help="pieces kept whole, never split"
    )
    parser.add_argument("--threads", type=int, default=defaults.threads, help="CPU threads")
    add_force(parser, "replace an existing tokenizer at --out")
    parser.add_argument("--verbose", action="store_true", help="SentencePiece's own log")
    return parser


@friendly_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    recipe = TokenizerRecipe(
        model_type=args.model_type,
        vocab_size=args.vocab_size,
        character_coverage=args.character_coverage,
        byte_fallback=args.byte_fallback,
        normalization=args.normalization,
        remove_extra_whitespaces=args.remove_extra_whitespaces,
        split_digits=args.split_digits,
        sample_documents=args.sample_documents,
        seed=args.seed,
        unk_id=args.unk_id,
        bos_id=args.bos_id,
        eos_id=args.eos_id,
        pad_id=args.pad_id,
        user_defined_symbols=args.user_defined_symbols,
        threads=args.threads,
    )
    trained = train_tokenizer(
        args.input,
        args.out,
        recipe,
        text_field=args.text_field,
        text_unit=args.text_unit,
        input_format=args.input_format,
        split=args.split,
        skip_missing_text=args.skip_missing_text,
        max_invalid_utf8=args.max_invalid_utf8,
        overwrite=args.force,
        verbose=args.verbose,
        command=sys.argv if argv is None else ["cqk", "data", "tokenizer", *argv],
    )
    print(
        f"wrote {trained.model} ({recipe.vocab_size} pieces, {trained.sentences:,} training "
        f"sentences from {trained.documents_sampled:,} documents, {trained.seconds:.1f} s) and "
        f"{trained.recipe_file}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
