"""UTF-8 checking of input files: invalid bytes are replaced with U+FFFD, counted and
reported, and the whole file is read in chunks so size does not matter."""

from __future__ import annotations

import bz2
import codecs
import gzip
import lzma
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from cqk_megatron.data.errors import DataError

_CHUNK = 16 << 20
_NON_BLANK = re.compile(r"\S")
_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
# what the decompressors raise for a file that is cut short or is not what its name says
_DECOMPRESSION_ERRORS = (EOFError, gzip.BadGzipFile, lzma.LZMAError, zlib.error, OSError)


def open_binary(path: Path) -> IO[bytes]:
    """The file's bytes, decompressed if its name ends in .gz, .bz2 or .xz."""
    opener = _OPENERS.get(path.suffix.lower())
    return opener(path, "rb") if opener else open(path, "rb")


class _Counter:
    """Counts replacements made by the ``cqk-count`` codec error handler."""

    count = 0
    first_offset: int | None = None
    base = 0

    @classmethod
    def reset(cls) -> None:
        cls.count, cls.first_offset, cls.base = 0, None, 0

    @classmethod
    def handler(cls, error: UnicodeError) -> tuple[str, int]:
        assert isinstance(error, UnicodeDecodeError)
        cls.count += 1
        if cls.first_offset is None:
            cls.first_offset = cls.base + error.start
        return "\ufffd", error.end


codecs.register_error("cqk-count", _Counter.handler)


@dataclass
class Utf8Report:
    path: Path
    bytes: int
    replaced: int  # invalid byte sequences replaced with U+FFFD
    first_bad_offset: int | None
    has_text: bool  # anything but whitespace


def _unreadable(path: Path, error: Exception) -> DataError:
    """A compressed input that cannot be read to its end, as one line naming it."""
    kind = path.suffix.lower()
    if isinstance(error, EOFError):
        what = "its compressed data ends before the end-of-stream marker (truncated?)"
    else:
        what = str(error)
    return DataError(
        f"input '{path}' is not a readable {kind} file: {what}; copy or compress it again, "
        "or leave it out of the inputs"
    )


def _read_chunks(path: Path) -> Iterator[bytes]:
    """The file's bytes in chunks; a damaged compressed file raises ``DataError``."""
    try:
        with open_binary(path) as stream:
            while chunk := stream.read(_CHUNK):
                yield chunk
    except _DECOMPRESSION_ERRORS as error:
        if path.suffix.lower() not in _OPENERS:
            raise  # a plain file that cannot be read: not a decompression problem
        raise _unreadable(path, error) from error


def _decode_chunks(path: Path):
    """Yield decoded text chunks; a multi-byte character split by a chunk boundary is kept
    whole (the decoder reports how far it got)."""
    _Counter.reset()
    pending = b""
    position = 0
    chunks = _read_chunks(path)
    while True:
        chunk = next(chunks, b"")
        final = not chunk
        data = pending + chunk
        _Counter.base = position
        text, consumed = codecs.utf_8_decode(data, "cqk-count", final)
        pending = data[consumed:]
        position += consumed
        yield text, position
        if final:
            return


def scan_utf8(path: Path) -> Utf8Report:
    has_text = False
    size = 0
    for text, position in _decode_chunks(path):
        has_text = has_text or bool(_NON_BLANK.search(text))
        size = position
    return Utf8Report(path, size, _Counter.count, _Counter.first_offset, has_text)


def write_repaired(path: Path, destination: Path) -> None:
    """``path`` decoded with invalid bytes replaced, written as clean UTF-8."""
    with open(destination, "w", encoding="utf-8", newline="") as out:
        for text, _ in _decode_chunks(path):
            out.write(text)
