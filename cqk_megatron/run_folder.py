"""The files of a run folder ``log.root/name`` that training writes and every tool reads.

- ``config.yaml``: the resolved config, replaced only when a run really starts (after
  its lease is taken and its checkpoint chosen), so a refused attempt never rewrites it;
- ``metrics.jsonl``: see ``cqk_megatron.training.metrics`` (writer and the one reader);
- ``lease.json``: which process holds the run (``cqk_megatron.run_lease``);
- ``checkpoints/``: ``cqk_megatron.checkpoint_files``;
- ``superseded/<UTC time>/``: what a run moved out of the way instead of deleting it
  (checkpoints newer than the one it resumed from, or everything on ``--resume none``).

Torch-free: the launcher, analysis and repro read run folders without Megatron.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

import yaml

from cqk_megatron.atomic import write_text_atomically
from cqk_megatron.config import RunConfig, to_dict

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
LEASE = "lease.json"
CHECKPOINTS = "checkpoints"
SUPERSEDED = "superseded"


def run_dir_of(config: RunConfig) -> Path:
    return Path(config.log.root) / config.name


def write_config(run_dir: Path, config: RunConfig) -> None:
    """``config.yaml``, atomically (a reader never sees half of it)."""
    text = yaml.safe_dump(to_dict(config), sort_keys=False)
    try:
        write_text_atomically(run_dir / CONFIG, text)
    except OSError as error:
        raise no_space_error(run_dir / CONFIG, error) from error


def supersede(run_dir: Path, paths: list[Path]) -> Path | None:
    """Move ``paths`` (inside ``run_dir``) to ``run_dir/superseded/<UTC time>/``, keeping
    their relative paths; renames only (instant, nothing copied, nothing deleted)."""
    paths = [p for p in paths if p.exists()]
    if not paths:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = run_dir / SUPERSEDED / stamp
    suffix = 1
    while target.exists():
        suffix += 1
        target = run_dir / SUPERSEDED / f"{stamp}-{suffix}"
    for path in paths:
        destination = target / path.relative_to(run_dir)
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, destination)
    return target


def _existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Free bytes (for this user) on the filesystem that holds or would hold ``path``."""
    return shutil.disk_usage(_existing_ancestor(path)).free


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def is_no_space(error: BaseException) -> bool:
    """``error`` (or what caused it) is a full disk or quota. PyTorch's zip writer reports
    a short write as ``enforce fail at inline_container.cc ... unexpected pos``."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(error)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        if "inline_container" in text and "unexpected pos" in text:
            return True
        error = error.__cause__ or error.__context__
    return False


class NoSpaceError(OSError):
    """A write that failed because its filesystem is full; the message says where."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOSPC


def no_space_error(path: Path, error: BaseException, what: str = "") -> BaseException:
    """``error`` as a ``NoSpaceError`` naming the path and the free space, if it was a full
    disk; else ``error`` itself."""
    if isinstance(error, NoSpaceError) or not is_no_space(error):
        return error
    free = free_bytes(path)
    mount = _existing_ancestor(path)
    return NoSpaceError(
        f"no space left on device writing {what or path} ({human_bytes(free)} free on the "
        f"filesystem of {mount}); free space there or point log.root at a larger filesystem",
    )
