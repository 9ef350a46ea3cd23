"""Reading corpora with Hugging Face ``datasets`` into one ``text`` column.

Inputs: plain text files (one document per line, per blank-line-separated paragraph, or
per file), JSON lines (a chosen text field), Parquet (a chosen column), folders saved with
``Dataset.save_to_disk``, folders of such files, and (where the network allows, never in
tests) ``hub:NAME[:CONFIG]``. Each file is checked before loading: empty files, unknown
types, a missing or non-text field and undecodable bytes get errors or reports that name
the file. Documents keep the order of the inputs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cqk_megatron.data.errors import DataError
from data_tools.utf8 import open_binary, scan_utf8, write_repaired

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz")
FORMATS = ("text", "json", "parquet")
TEXT_UNITS = {"line": "line", "paragraph": "paragraph", "file": "document"}
# Above this fraction of a file's bytes in invalid UTF-8 sequences, a "text" file is not
# text: random or compressed bytes run to about 40%, executables to 25-30%, text in Latin-1
# or another 8-bit encoding to a few percent (its accented letters), which is replaced and
# reported instead.
MAX_INVALID_UTF8 = 0.2

_SUPPORTED = (
    "supported: .txt/.text/.md/.rst (plain text), .jsonl/.json/.ndjson (JSON lines), "
    ".parquet, each of the first two optionally .gz/.bz2/.xz; or a folder saved with "
    "datasets' save_to_disk"
)


@dataclass
class FileReport:
    path: str
    format: str
    bytes: int = 0
    documents: int = 0
    replaced_bytes: int = 0  # invalid UTF-8 sequences replaced with U+FFFD
    first_bad_offset: int | None = None


@dataclass
class Corpus:
    """A ``datasets.Dataset`` with one ``text`` column, and what each input contributed."""

    dataset: object
    files: list[FileReport] = field(default_factory=list)

    @property
    def replaced_bytes(self) -> int:
        return sum(f.replaced_bytes for f in self.files)

    def __len__(self) -> int:
        return len(self.dataset)


def _strip_compression(path: Path) -> tuple[str, str]:
    """('.jsonl', '.gz') for data.jsonl.gz, ('.txt', '') for a.txt."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSED_SUFFIXES:
        return (suffixes[-2] if len(suffixes) > 1 else ""), suffixes[-1]
    return (suffixes[-1] if suffixes else ""), ""


def detect_format(path: Path, forced: str | None = None) -> str:
    if forced is not None:
        if forced not in FORMATS:
            raise DataError(f"--input-format {forced!r} is unknown; choose one of {list(FORMATS)}")
        return forced
    kind, compression = _strip_compression(path)
    if kind in TEXT_SUFFIXES:
        return "text"
    if kind in JSON_SUFFIXES:
        return "json"
    if kind in PARQUET_SUFFIXES and not compression:
        return "parquet"
    shown = kind + compression or "(no extension)"
    raise DataError(
        f"input '{path}': unknown file type {shown}; {_SUPPORTED}. Rename the file or pass "
        "--input-format text|json|parquet to say what it holds"
    )


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


def _expand(inputs: list[str]) -> list[str | Path]:
    """Files as given, folders of files expanded (sorted), saved datasets and hub names kept."""
    expanded: list[str | Path] = []
    if not inputs:
        raise DataError("no inputs given; pass text, JSONL or Parquet files, or folders of them")
    for item in inputs:
        if item.startswith("hub:"):
            expanded.append(item)
            continue
        path = Path(item).expanduser()
        if not path.exists():
            raise DataError(f"input '{item}' does not exist; check the path")
        if path.is_dir() and not _is_saved_dataset(path):
            files = sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
                and _strip_compression(p)[0] in TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES
            )
            if not files:
                raise DataError(
                    f"input folder '{item}' holds no data files and is not a folder saved with "
                    f"save_to_disk; {_SUPPORTED}"
                )
            expanded.extend(files)
        else:
            expanded.append(path)
    return expanded


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    # critical: datasets logs a failed JSON load at error level, naming its internal types;
    # the failure is reported (with the line) by _load_files instead
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if was_enabled:
            datasets.enable_progress_bars()


def _kind_of(value: object) -> str:
    """What a JSON value is, in words."""
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _describe_feature(feature: object) -> str:
    """A ``datasets`` feature type in words (not ``Json(decode=True)``)."""
    dtype = getattr(feature, "dtype", None)
    if dtype in ("string", "large_string"):
        return "text"
    if isinstance(dtype, str) and dtype not in ("null", "binary", "large_binary"):
        return f"{dtype} values, not text"
    if isinstance(feature, list | dict) or type(feature).__name__ in ("Sequence", "List"):
        return "lists or objects, not text"
    return "values of mixed or non-text types"


def _json_lines(path: Path):
    """(line number from 1, text) of a JSON-lines file, decompressed, bad bytes replaced."""
    with open_binary(path) as handle:
        for number, raw in enumerate(handle, start=1):
            yield number, raw.decode("utf-8", errors="replace")


def first_bad_json_line(path: Path, text_field: str) -> str | None:
    """Where a JSON-lines file goes wrong, as '<line N> ...' (None: nothing found)."""
    import json

    for number, text in _json_lines(path):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except ValueError as error:
            return f"line {number} is not valid JSON ({error.args[0].split(':')[0]})"
        if not isinstance(record, dict):
            return f"line {number} holds {_kind_of(record)}, not a JSON object"
        if text_field in record and not isinstance(record[text_field], str | None):
            return f"line {number}'s '{text_field}' is {_kind_of(record[text_field])}, not text"
    return None


def lines_without_text(path: Path, text_field: str) -> tuple[int, int | None]:
    """(records lacking ``text_field`` or holding null there, the first one's line)."""
    import json

    count, first = 0, None
    for number, text in _json_lines(path):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get(text_field) is None:
            count += 1
            first = first or number
    return count, first


def _text_column(ds, source: str, text_field: str, fmt: str, load_path: Path | None = None):
    """``ds`` reduced to a string column named ``text``; errors name ``source``."""
    if text_field not in ds.column_names:
        option = "--text-field" if fmt != "text" else "--input-format"
        raise DataError(
            f"input '{source}' has no field '{text_field}' (its fields: "
            f"{', '.join(ds.column_names) or 'none'}); pass {option} with the field that holds "
            "the text"
        )
    dtype = getattr(ds.features[text_field], "dtype", None)
    if dtype not in ("string", "large_string"):
        where = first_bad_json_line(load_path, text_field) if fmt == "json" and load_path else None
        held = where or f"it holds {_describe_feature(ds.features[text_field])}"
        raise DataError(
            f"input '{source}': field '{text_field}' is not text ({held}); fix those records "
            "or pass --text-field with a field of strings"
        )
    ds = ds.select_columns([text_field])
    if text_field != "text":
        ds = ds.rename_column(text_field, "text")
    return ds


def _check_has_text(
    ds,
    source: str,
    text_field: str,
    fmt: str = "json",
    load_path: Path | None = None,
    skip_missing: bool = False,
    report=print,
) -> None:
    import pyarrow.compute as pc

    column = ds.data.column("text")
    if len(ds) == 0:
        raise DataError(f"input '{source}' holds no records; remove it from the inputs")
    trimmed = pc.utf8_length(pc.utf8_trim_whitespace(column))
    if not pc.any(pc.greater(trimmed, 0)).as_py():
        raise DataError(
            f"input '{source}': every '{text_field}' value is empty or null; remove the file or "
            "pass --text-field with the field that holds the text"
        )
    missing = column.null_count
    if missing and fmt != "text":
        first = None
        if fmt == "json" and load_path is not None:
            _, first = lines_without_text(load_path, text_field)
        where = f"; the first at line {first}" if first else ""
        text = (
            f"input '{source}': {missing} of {len(ds)} records have no '{text_field}' field "
            f"(or a null one{where})"
        )
        if not skip_missing:
            raise DataError(
                f"{text}; fix or remove them, pass --text-field if the text is in another "
                "field, or --skip-missing-text to leave those records out"
            )
        report(f"warning: {text}; left out (--skip-missing-text)")


def _paragraph_hint(path: Path, documents: int, text_unit: str, report) -> None:
    """A text file that gave very few paragraphs from many lines: say so (a corpus with one
    document per line, tokenized by paragraph, becomes one huge document)."""
    if text_unit != "paragraph" or documents > 2:
        return
    with open_binary(path) as handle:
        lines = sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b""))
    if lines >= 10:
        report(
            f"warning: '{path}' gave {documents} document(s) with --text-unit paragraph "
            f"(blank-line separated) from {lines} lines; if it holds one document per line, "
            "pass --text-unit line"
        )


def _load_files(
    paths: list[Path],
    fmt: str,
    options: dict,
    cache_dir: Path,
    originals: list[Path] | None = None,
    text_field: str = "text",
) -> list:
    """One ``load_dataset`` call for all files of a format, each file its own split (keeps
    files apart for reporting); on failure, file by file to name the culprit (by the name
    the user gave, not a repaired temporary copy)."""
    import datasets

    originals = originals or paths
    builder = {"text": "text", "json": "json", "parquet": "parquet"}[fmt]
    data_files = {f"file{i}": str(p) for i, p in enumerate(paths)}
    try:
        loaded = datasets.load_dataset(
            builder, data_files=data_files, cache_dir=str(cache_dir), **options
        )
        return [loaded[f"file{i}"] for i in range(len(paths))]
    except Exception as error:  # re-raised below, naming the file
        if len(paths) == 1:
            where = first_bad_json_line(paths[0], text_field) if fmt == "json" else None
            if where is None:
                cause = str(error.__cause__ or error)
                # Arrow counts rows from 0 within a block: not a line number to show
                where = re.sub(r"\s*in row \d+", "", cause.split(": ", 1)[-1]).strip()
            hint = {
                "json": "each line must be one JSON object; fix the file, or pass "
                "--input-format text if it is plain text",
                "parquet": "it must be a Parquet file; fix it or pass --input-format",
                "text": "check the file",
            }[fmt]
            raise DataError(f"cannot read '{originals[0]}' as {fmt}: {where}; {hint}") from error
        return [
            ds
            for p, original in zip(paths, originals, strict=True)
            for ds in _load_files([p], fmt, options, cache_dir, [original], text_field)
        ]


def open_corpus(
    inputs: list[str],
    workdir: Path,
    text_field: str = "text",
    text_unit: str = "paragraph",
    input_format: str | None = None,
    split: str = "train",
    report=print,
    skip_missing_text: bool = False,
    max_invalid_utf8: float = MAX_INVALID_UTF8,
) -> Corpus:
    """All inputs as one dataset with a ``text`` column, in input order. ``workdir`` holds
    the Arrow cache and repaired copies of files with bad bytes; keep it while the corpus
    is in use. A text or JSON file with more than ``max_invalid_utf8`` of its bytes in
    invalid UTF-8 sequences is refused as not text."""
    import datasets

    if text_unit not in TEXT_UNITS:
        raise DataError(f"--text-unit {text_unit!r} is unknown; choose one of {list(TEXT_UNITS)}")
    cache_dir = workdir / "hf-cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    items = _expand(inputs)
    pieces: list[tuple[int, object]] = []
    reports: list[FileReport] = []
    files_by_format: dict[str, list[tuple[int, Path, Path, FileReport]]] = {f: [] for f in FORMATS}

    for position, item in enumerate(items):
        if isinstance(item, str):  # hub:NAME[:CONFIG]
            name, _, config = item[4:].partition(":")
            with _quiet_datasets():
                ds = datasets.load_dataset(
                    name, config or None, split=split, cache_dir=str(cache_dir)
                )
            ds = _text_column(ds, item, text_field, "json")
            reports.append(FileReport(item, "hub", documents=len(ds)))
            pieces.append((position, ds))
        elif item.is_dir():  # saved with save_to_disk
            loaded = datasets.load_from_disk(str(item))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise DataError(
                        f"input '{item}' has splits {list(loaded)} but no '{split}'; pass --split"
                    )
                loaded = loaded[split]
            ds = _text_column(loaded, str(item), text_field, "json")
            _check_has_text(ds, str(item), text_field)
            reports.append(FileReport(str(item), "datasets", documents=len(ds)))
            pieces.append((position, ds))
        else:
            fmt = detect_format(item, input_format)
            load_path = item
            file_report = FileReport(str(item), fmt, bytes=item.stat().st_size)
            if fmt in ("text", "json"):
                scan = scan_utf8(item)
                if not scan.has_text:
                    raise DataError(
                        f"input '{item}' is empty ({scan.bytes} bytes, no text); remove it from "
                        "the inputs"
                    )
                _check_mostly_utf8(item, scan.replaced, scan.bytes, max_invalid_utf8)
                if scan.replaced:
                    load_path = workdir / f"repaired-{position}{_strip_compression(item)[0]}"
                    write_repaired(item, load_path)
                    file_report.replaced_bytes = scan.replaced
                    file_report.first_bad_offset = scan.first_bad_offset
                    report(
                        f"warning: '{item}' is not valid UTF-8: replaced {scan.replaced} bad byte "
                        f"sequence(s) with U+FFFD (first at byte {scan.first_bad_offset}); "
                        "re-encode the file as UTF-8 to keep those characters"
                    )
            elif item.stat().st_size == 0:
                raise DataError(f"input '{item}' is empty (0 bytes); remove it from the inputs")
            files_by_format[fmt].append((position, item, load_path, file_report))
            reports.append(file_report)

    options = {
        "text": {"sample_by": TEXT_UNITS[text_unit]},
        "json": {},
        "parquet": {},
    }
    for fmt, entries in files_by_format.items():
        if not entries:
            continue
        field_name = "text" if fmt == "text" else text_field
        with _quiet_datasets():
            loaded = _load_files(
                [e[2] for e in entries],
                fmt,
                options[fmt],
                cache_dir,
                [e[1] for e in entries],
                field_name,
            )
        for (position, original, load_path, file_report), ds in zip(entries, loaded, strict=True):
            ds = _text_column(ds, str(original), field_name, fmt, load_path)
            _check_has_text(
                ds, str(original), field_name, fmt, load_path, skip_missing_text, report
            )
            pieces.append((position, ds))
            file_report.documents = len(ds)
            if fmt == "text":
                _paragraph_hint(original, len(ds), text_unit, report)

    pieces.sort(key=lambda piece: piece[0])
    parts = [ds for _, ds in pieces]
    dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return Corpus(dataset, reports)


def _check_mostly_utf8(path: Path, replaced: int, size: int, limit: float) -> None:
    if size and replaced / size > limit:
        raise DataError(
            f"input '{path}' is not text: {replaced:,} of its {size:,} bytes "
            f"({replaced / size:.1%}) are invalid UTF-8 sequences, more than "
            f"--max-invalid-utf8 {limit:g} ({limit:.0%}) allows; convert it to UTF-8 (e.g. "
            "iconv -f latin1 -t utf-8), leave it out of the inputs, or raise "
            "--max-invalid-utf8 to tokenize it with those bytes replaced by U+FFFD"
        )


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction between 0 and 1")
    return value


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """Input options shared with the tokenizer trainer."""
    parser.add_argument("--input", nargs="+", required=True, help="files, folders, or hub:NAME")
    parser.add_argument("--text-field", default="text", help="JSONL/Parquet/datasets field")
    parser.add_argument(
        "--text-unit",
        default="paragraph",
        choices=list(TEXT_UNITS),
        help="what one document is in a plain text file",
    )
    parser.add_argument("--input-format", choices=FORMATS, help="override the file extension")
    parser.add_argument("--split", default="train", help="split of a saved DatasetDict / hub set")
    parser.add_argument(
        "--skip-missing-text",
        action="store_true",
        help="leave out JSONL/Parquet records without the text field (default: an error)",
    )
    parser.add_argument(
        "--max-invalid-utf8",
        type=fraction,
        default=MAX_INVALID_UTF8,
        metavar="FRACTION",
        help="refuse a text/JSONL file with more than this fraction of its bytes in invalid "
        "UTF-8 sequences (below it they are replaced with U+FFFD and reported; default: "
        "%(default)s)",
    )
