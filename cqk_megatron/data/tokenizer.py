"""Tokenizers for training and preprocessing: a SentencePiece ``.model`` or a local
Hugging Face tokenizer folder, behind one small interface.

Megatron's datasets read ``vocab_size``, ``eod`` and ``pad`` from the tokenizer they are
given (duck-typed: ``GPTDatasetConfig`` only uses those attributes), so these classes do
not derive from ``MegatronTokenizerBase``; that keeps this module free of Megatron and
torch imports, which matters for the preprocessing worker processes that load it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from cqk_megatron.config import ConfigError, RunConfig
from cqk_megatron.data.errors import DataError

_FIX_MISSING = (
    "train one with cqk data tokenizer (or cqk data demo-corpus), or point data.tokenizer at a "
    "SentencePiece .model file or a local Hugging Face tokenizer folder"
)


class Tokenizer:
    """What the data pipeline needs from a tokenizer.

    ``eod`` is appended to every document; ``pad`` is -1 when the tokenizer has none
    (Megatron's own "no pad" value).
    """

    kind: str = "abstract"
    path: str = ""
    vocab_size: int
    eod: int
    pad: int = -1
    bos: int | None = None

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(text) for text in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def normalize(self, text: str) -> str:
        """The text as ``detokenize(tokenize(text))`` gives it back (the model's normalisation)."""
        return text

    def pieces(self, ids: Iterable[int]) -> list[str]:
        """Readable token strings, for statistics."""
        return [self.detokenize([i]) for i in ids]

    # Megatron names
    @property
    def eos(self) -> int:
        return self.eod

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": self.path,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "pad": self.pad,
            "bos": self.bos,
        }

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        """Megatron puts this in its dataset cache key (a changed tokenizer, a new cache)."""
        return {"class": type(self).__name__} | self.describe()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, vocab_size={self.vocab_size})"


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: str | Path) -> None:
        import sentencepiece as spm

        self.path = str(path)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.path)
        except (OSError, RuntimeError) as error:
            raise DataError(
                f"tokenizer '{path}' is not a SentencePiece model ({error}); {_FIX_MISSING}"
            ) from error
        if self._sp.eos_id() < 0:
            raise DataError(
                f"tokenizer '{path}' has no end-of-document piece (eos_id=-1), which every "
                "document needs; retrain it with an EOS id (cqk data tokenizer's default "
                "--eos-id 2)"
            )
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        self.pad = self._sp.pad_id()
        self.bos = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        # SentencePiece marks spaces with U+2581 and, with add_dummy_prefix, puts one in
        # front of the text; normalize() undoes both to compare with decoded text.
        self._dummy_prefix = self._sp.normalize("x").startswith("\u2581")

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        # one thread: the preprocessing workers are the parallelism
        return self._sp.encode(list(texts), num_threads=num_threads)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def normalize(self, text: str) -> str:
        normalized = self._sp.normalize(text).replace("\u2581", " ")
        if self._dummy_prefix and normalized.startswith(" "):
            normalized = normalized[1:]
        return normalized

    def pieces(self, ids: Iterable[int]) -> list[str]:
        return [self._sp.id_to_piece(int(i)) for i in ids]


class HuggingFaceTokenizer(Tokenizer):
    kind = "huggingface"

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        try:
            import transformers
        except ImportError as error:
            raise DataError(
                f"tokenizer folder '{path}' is a Hugging Face tokenizer, which needs the "
                "transformers package: pip install transformers"
            ) from error
        # the Rust tokenizer's own threads would fight the preprocessing worker processes
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        try:
            self._tok = transformers.AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except (OSError, ValueError) as error:
            raise DataError(
                f"cannot load the Hugging Face tokenizer in '{path}' ({error}); the folder "
                "needs tokenizer.json or tokenizer_config.json as save_pretrained() writes them"
            ) from error
        if self._tok.eos_token_id is None:
            raise DataError(
                f"Hugging Face tokenizer '{path}' defines no eos_token, which marks the end of "
                'every document; set "eos_token" in its tokenizer_config.json'
            )
        self.vocab_size = len(self._tok)
        self.eod = int(self._tok.eos_token_id)
        self.pad = -1 if self._tok.pad_token_id is None else int(self._tok.pad_token_id)
        self.bos = None if self._tok.bos_token_id is None else int(self._tok.bos_token_id)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def normalize(self, text: str) -> str:
        rust_tokenizer = getattr(self._tok, "backend_tokenizer", None)
        normalizer = getattr(rust_tokenizer, "normalizer", None)
        return normalizer.normalize_str(text) if normalizer is not None else text

    def pieces(self, ids: Iterable[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens([int(i) for i in ids])


class IdsOnlyTokenizer(Tokenizer):
    """Special ids and vocabulary size without a vocabulary: for mock data, and for a
    dataset whose metadata records its tokenizer when the tokenizer file is elsewhere."""

    kind = "ids"

    def __init__(self, vocab_size: int, eod: int, pad: int = -1, source: str = "") -> None:
        self.path = source
        self.vocab_size = vocab_size
        self.eod = eod
        self.pad = pad

    def tokenize(self, text: str) -> list[int]:
        raise DataError(f"no tokenizer file for {self.path or 'this data'}; set data.tokenizer")

    def detokenize(self, ids: Iterable[int]) -> str:
        raise DataError(f"no tokenizer file for {self.path or 'this data'}; set data.tokenizer")

    def pieces(self, ids: Iterable[int]) -> list[str]:
        return [f"<{int(i)}>" for i in ids]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A SentencePiece ``.model`` file, or a folder holding a Hugging Face tokenizer
    (``tokenizer.json`` / ``tokenizer_config.json``) or a single ``tokenizer.model``."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"tokenizer '{path}' does not exist; {_FIX_MISSING}")
    if p.is_dir():
        if (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file():
            return HuggingFaceTokenizer(p)
        if (p / "tokenizer.model").is_file():
            return SentencePieceTokenizer(p / "tokenizer.model")
        raise DataError(
            f"tokenizer folder '{path}' holds neither tokenizer.json/tokenizer_config.json "
            f"(Hugging Face) nor tokenizer.model (SentencePiece); {_FIX_MISSING}"
        )
    return SentencePieceTokenizer(p)


def check_vocab_fits(tokenizer: Tokenizer, config: RunConfig) -> None:
    """Every token id the tokenizer can produce must have a row in the model's embedding."""
    have, room = tokenizer.vocab_size, config.model.vocab_size
    if have > room:
        raise ConfigError(
            f"tokenizer '{tokenizer.path}' has {have} tokens but model.vocab_size={room}: ids "
            f"up to {have - 1} would fall outside the model's vocabulary; set "
            f"model.vocab_size={have} (or more), or use a tokenizer with at most {room} tokens"
        )
