"""What ``--data`` / ``--tokenizer`` point at, turned into an indexed dataset and a tokenizer.

- nothing: the embedded demo corpus, built (once, then reused) into ``OUT/data``;
- an indexed dataset prefix ``P`` (``P.bin`` + ``P.idx``), or a folder holding exactly
  one: used as it is; the tokenizer is ``--tokenizer``, else the one its ``P.meta.json``
  records, else ``tokenizer.model`` beside it;
- a text/JSON-lines/Parquet file or a folder of them: tokenized (and, without
  ``--tokenizer``, a SentencePiece tokenizer trained on it) into ``OUT/data`` by the data
  tools, once; a later run with the same inputs (and reading options: ``--text-unit``,
  ``--text-field``, ``--input-format``) reuses it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from cqk_megatron.data.errors import DataError
from cqk_megatron.data.metadata import bin_path, idx_path, read_meta
from cqk_megatron.repro.presets import Preset, ReproError
from data_tools.sources import MAX_INVALID_UTF8

CORPUS_PREFIX = "corpus_text_document"


@dataclass(frozen=True)
class CorpusOptions:
    """How the data tools read a corpus file (their --text-unit/--text-field/--input-format)."""

    text_unit: str = "paragraph"
    text_field: str = "text"
    input_format: str | None = None
    max_invalid_utf8: float = MAX_INVALID_UTF8  # --max-invalid-utf8

    def as_kwargs(self) -> dict:
        kwargs = {
            "text_unit": self.text_unit,
            "text_field": self.text_field,
            "input_format": self.input_format,
        }
        if self.max_invalid_utf8 != MAX_INVALID_UTF8:  # keeps the default's fingerprints
            kwargs["max_invalid_utf8"] = self.max_invalid_utf8
        return kwargs


@dataclass
class DataChoice:
    prefix: Path
    tokenizer: Path
    vocab_size: int
    description: str


def _is_prefix(path: Path) -> bool:
    return bin_path(path).is_file() and idx_path(path).is_file()


def _prefix_in_folder(folder: Path) -> Path | None:
    prefixes = sorted(
        {p.with_suffix("") for p in folder.glob("*.idx") if _is_prefix(p.with_suffix(""))}
    )
    if len(prefixes) > 1:
        names = ", ".join(str(p) for p in prefixes)
        raise ReproError(
            f"--data {folder}: the folder holds {len(prefixes)} indexed datasets ({names}); "
            "give the prefix of the one to use"
        )
    return prefixes[0] if prefixes else None


def _tokenizer_for(prefix: Path, given: str | None) -> Path:
    if given is not None:
        path = Path(given).expanduser()
        if not path.exists():
            raise ReproError(
                f"--tokenizer {given}: no such file or folder; give a SentencePiece .model "
                "or a local Hugging Face tokenizer folder"
            )
        return path
    try:
        meta = read_meta(prefix)
    except DataError as error:
        raise ReproError(f"--data {prefix}: {error}") from error
    recorded = Path(meta["tokenizer"]["path"]) if meta and meta["tokenizer"].get("path") else None
    for candidate in (recorded, prefix.parent / "tokenizer.model"):
        if candidate is not None and candidate.exists():
            return candidate
    raise ReproError(
        f"--data {prefix}: no tokenizer found (none recorded in {prefix}.meta.json, no "
        f"tokenizer.model beside it); pass --tokenizer PATH"
    )


def _vocab_size(tokenizer: Path) -> int:
    from cqk_megatron.data.tokenizer import load_tokenizer

    try:
        return int(load_tokenizer(tokenizer).vocab_size)
    except (DataError, OSError, RuntimeError) as error:
        raise ReproError(f"--tokenizer {tokenizer}: cannot be loaded: {error}") from error


def _demo(folder: Path) -> DataChoice:
    from data_tools.demo_corpus import DemoSettings, build_demo

    settings = DemoSettings()
    outputs = build_demo(folder, settings, progress=False)
    how = "reused" if outputs.skipped else "built"
    return DataChoice(
        outputs.prefix,
        outputs.tokenizer,
        settings.vocab_size,
        f"embedded demo corpus ({how}: {outputs.documents} documents, {outputs.tokens:,} tokens)",
    )


def _fingerprint(
    paths: list[Path], tokenizer: str | None, vocab: int, reading: CorpusOptions
) -> str:
    """Inputs' paths, sizes and modification times, and how they are read: a changed
    corpus (or another --text-unit) is re-tokenized."""
    files = sorted(p for path in paths for p in ([path] if path.is_file() else path.rglob("*")))
    stats = [
        (str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.is_file()
    ]
    key = [stats, tokenizer, vocab]
    if reading != CorpusOptions():  # the default keeps fingerprints made before the options
        key.append(reading.as_kwargs())
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()


def _corpus(
    path: Path, tokenizer: str | None, preset: Preset, folder: Path, reading: CorpusOptions
) -> DataChoice:
    from data_tools.preprocess import preprocess
    from data_tools.tokenizer import TokenizerRecipe, train_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    prefix = folder / CORPUS_PREFIX
    stamp = folder / "corpus.source.json"
    fingerprint = _fingerprint([path], tokenizer, preset.tokenizer_vocab, reading)
    model = Path(tokenizer).expanduser() if tokenizer else folder / "tokenizer.model"
    try:
        recorded = json.loads(stamp.read_text())["fingerprint"]
    except (OSError, ValueError, KeyError):
        recorded = None
    if recorded == fingerprint and _is_prefix(prefix) and model.exists():
        return DataChoice(prefix, model, _vocab_size(model), f"corpus {path} (tokenized before)")
    stamp.unlink(missing_ok=True)  # no stamp while rebuilding: never taken for complete
    try:
        if tokenizer is None:
            recipe = TokenizerRecipe(vocab_size=preset.tokenizer_vocab)
            train_tokenizer(
                [str(path)], folder / "tokenizer", recipe, overwrite=True, **reading.as_kwargs()
            )
        elif not model.exists():
            raise ReproError(f"--tokenizer {tokenizer}: no such file or folder")
        preprocess(
            [str(path)], prefix, model, overwrite=True, progress=False, **reading.as_kwargs()
        )
    except DataError as error:
        raise ReproError(f"--data {path}: {error}") from error
    stamp.write_text(json.dumps({"input": str(path.resolve()), "fingerprint": fingerprint}))
    return DataChoice(prefix, model, _vocab_size(model), f"corpus {path} (tokenized now)")


def resolve_data(
    data: str | None,
    tokenizer: str | None,
    preset: Preset,
    out: Path,
    reading: CorpusOptions | None = None,
) -> DataChoice:
    """The dataset and tokenizer every run of the comparison reads."""
    folder = out / "data"
    if data is None:
        if tokenizer is not None:
            raise ReproError(
                "--tokenizer without --data: the embedded demo corpus brings its own "
                "tokenizer; give --data too, or drop --tokenizer"
            )
        return _demo(folder)
    path = Path(data).expanduser()
    prefix = path if _is_prefix(path) else (_prefix_in_folder(path) if path.is_dir() else None)
    if prefix is not None:
        model = _tokenizer_for(prefix, tokenizer)
        return DataChoice(prefix, model, _vocab_size(model), f"indexed dataset {prefix}")
    if path.exists():
        return _corpus(path, tokenizer, preset, folder, reading or CorpusOptions())
    half = [p for p in (bin_path(path), idx_path(path)) if p.exists()]
    if half:
        raise ReproError(
            f"--data {data}: only {half[0].name} exists; an indexed dataset needs both .bin "
            "and .idx (re-run cqk data preprocess)"
        )
    raise ReproError(
        f"--data {data}: no such file, folder or dataset prefix ({data}.bin/.idx); give an "
        "indexed dataset prefix, a corpus file or folder, or leave --data out to use the "
        "embedded demo corpus"
    )
