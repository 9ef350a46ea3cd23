"""What a filesystem says when no write there can succeed as things are (full, over quota,
read-only, not ours to write, a name too long), and the one refusal every write of a run
turns it into: ``NoSpaceError`` naming the path, the free space and the fix, exit 2, so
that no launcher relaunches into it. ``run/folder.py`` re-exports it; ``run/lease.py``
uses it without the run folder's contract."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from cqk_megatron.errors import Refusal


def _existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _mount_point(path: Path) -> Path:
    """The folder where the filesystem that holds ``path`` is mounted (what to free)."""
    folder = _existing_ancestor(path)
    device = folder.stat().st_dev
    while folder.parent != folder and folder.parent.stat().st_dev == device:
        folder = folder.parent
    return folder


def free_bytes(path: Path) -> int:
    """Free bytes (for this user) on the filesystem that holds or would hold ``path``."""
    return shutil.disk_usage(_existing_ancestor(path)).free


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def is_no_space(error: BaseException | None) -> bool:
    """``error`` (or what caused it) is a full disk or quota. PyTorch's zip writer reports
    a short write as ``enforce fail at inline_container.cc ... unexpected pos``."""
    return _unwritable_errno(error) in (errno.ENOSPC, errno.EDQUOT)


# What a filesystem says when no write there can succeed as things are: running the same
# job again cannot help, so the run is refused (exit 2), not relaunched into it.
_UNWRITABLE = {
    errno.ENOSPC: (
        "no space left on device",
        "free space there or point log.root at a larger filesystem",
    ),
    errno.EDQUOT: (
        "disk quota exceeded",
        "free space in your quota there or point log.root at another filesystem",
    ),
    errno.EROFS: ("read-only filesystem", "point log.root at a writable folder"),
    errno.EACCES: ("permission denied", "point log.root at a folder you can write"),
    errno.ENAMETOOLONG: (
        "file name too long",
        "shorten the name (each path component "
        "holds at most 255 bytes): name=, log.root or the data paths",
    ),
}


def _unwritable_errno(error: BaseException | None) -> int | None:
    """The errno of ``error`` or its causes that says the filesystem refuses writes."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _UNWRITABLE:
            return error.errno
        text = str(error)
        if "No space left on device" in text:
            return errno.ENOSPC
        if "Disk quota exceeded" in text:
            return errno.EDQUOT
        if "inline_container" in text and "unexpected pos" in text:
            return errno.ENOSPC
        if "Read-only file system" in text:
            return errno.EROFS
        error = error.__cause__ or error.__context__
    return None


def names_unwritable(message: str) -> bool:
    """``message`` is a ``NoSpaceError``'s (as gathered from another rank, as text)."""
    return message.startswith(tuple(cause for cause, _ in _UNWRITABLE.values()))


def is_unwritable(error: BaseException) -> bool:
    """``error`` says the filesystem refuses the write: full, over quota, read-only, not
    ours to write, or a name too long."""
    return _unwritable_errno(error) is not None


class NoSpaceError(Refusal, OSError):
    """A write the filesystem refused (full, over quota, read-only, not writable, a name
    too long); the message says where, the free space and the fix. A refusal: the run
    stops with exit 2 and is not relaunched into the same filesystem."""

    def __init__(self, message: str, code: int = errno.ENOSPC) -> None:
        super().__init__(message)
        self.errno = code


def no_space_error(path: Path, error: BaseException, what: str = "") -> BaseException:
    """``error`` as a ``NoSpaceError`` naming the path, the cause, the free space and the
    fix, if the filesystem refused the write; else ``error`` itself."""
    code = _unwritable_errno(error)
    if isinstance(error, NoSpaceError) or code is None:
        return error
    cause, fix = _UNWRITABLE[code]
    try:
        mount = _mount_point(path)
        room = f"{human_bytes(free_bytes(path))} free on the filesystem of {mount}"
    except OSError:  # the name itself is what the filesystem refuses
        room = "free space unknown"
    doing = ":" if code == errno.ENAMETOOLONG else " writing"  # a read meets it too
    return NoSpaceError(f"{cause}{doing} {what or path} ({room}); {fix}", code)


def unwritable_folder(folder: Path) -> NoSpaceError | None:
    """The refusal a write in ``folder`` would meet (or the making of it, under its nearest
    existing folder): a read-only filesystem, or a folder this user may not write; None
    where a write may go ahead. Checked before a run starts, so that a read-only
    ``log.root`` or run folder is refused as a full disk is, before anything is written."""
    existing = _existing_ancestor(folder)
    if os.access(existing, os.W_OK):
        return None
    code = errno.EROFS if os.statvfs(existing).f_flag & os.ST_RDONLY else errno.EACCES
    refused = no_space_error(folder, OSError(code, os.strerror(code), str(existing)))
    return refused if isinstance(refused, NoSpaceError) else None
