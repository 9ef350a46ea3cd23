"""Write a file through a temporary sibling renamed over it: a crash never leaves half a
file, and a reader never sees one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path next to ``path`` to write; on success it replaces ``path``,
    on an error it is removed.

    The file gets the permissions a plain ``open`` would give (``0o666`` less the umask),
    set after the block, whatever the writer did: ``mkstemp`` makes it ``0600``, and so
    does safetensors' ``save_file`` (it writes its own temporary and renames it), and
    reports, configs, metrics and exported weights that only their writer can read are
    no use to the rest of a team on a shared cluster.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    temporary = Path(name)
    try:
        yield temporary
        os.chmod(temporary, 0o666 & ~current_umask())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def current_umask() -> int:
    """The process's umask (reading it means setting it: put it straight back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def write_text_atomically(path: Path | str, text: str) -> None:
    with atomic_path(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


def append_line(path: Path | str, line: str) -> None:
    """Append ``line`` and a newline to ``path``: the whole line or nothing.

    A record file's reader skips a line cut short, but the next record would then be
    glued to it; a write that fails part-way (a disk that fills, a quota) is taken back,
    so the file still ends with a whole line. One ``write`` of a short line, so that two
    appending processes do not interleave; the file is cut back only when nobody else
    appended meanwhile. The error is the caller's to name.
    """
    data = (line.rstrip("\n") + "\n").encode("utf-8")
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        start = os.fstat(descriptor).st_size
        written = 0
        try:
            while written < len(data):
                written += os.write(descriptor, data[written:])
        except OSError:
            if written and os.fstat(descriptor).st_size == start + written:
                os.ftruncate(descriptor, start)
            raise
    finally:
        os.close(descriptor)
