"""Outputs that are either complete or absent.

Everything is written under temporary names beside its final place (same filesystem, so
``os.replace`` is atomic) and renamed at the end. A dataset's ``.idx`` is renamed last:
Megatron needs both files, so until that rename the prefix is not a dataset, and an
interrupted run never leaves a usable-looking but broken one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

from cqk_megatron.data.errors import DataError
from cqk_megatron.data.metadata import bin_path, holds_dataset, idx_path, meta_path

_PARTIAL = ".partial-"


def refuse_existing_dataset(prefix: Path, overwrite: bool) -> None:
    finals = (bin_path(prefix), idx_path(prefix), meta_path(prefix))
    if holds_dataset(prefix) and not overwrite:
        present = [path.name for path in finals if path.exists()]
        raise DataError(
            f"output prefix '{prefix}' already holds a dataset ({', '.join(present)}); pass "
            "--force to replace it, or choose another --out"
        )
    refuse_foreign_output(finals, meta_path(prefix), "cqk data preprocess")


def refuse_foreign_output(finals: Sequence[Path], record: Path, command: str) -> None:
    """``--force`` replaces only what ``command`` wrote there before, which it recognises by
    the ``record`` it writes beside its outputs (a dataset's ``.meta.json``, a tokenizer's
    ``.recipe.json``): a dataset or tokenizer made elsewhere, at a mistyped ``--out``, stays."""
    present = [path for path in finals if path.exists()]
    if present and not record.is_file():
        raise DataError(
            f"--force would replace {', '.join(p.name for p in present)} in '{record.parent}', "
            f"which {command} did not write (no {record.name} beside them); nothing was "
            "deleted: choose another --out, or remove them yourself if they really are to go"
        )


def refuse_existing_file(path: Path, overwrite: bool, option: str = "--out") -> None:
    if path.exists() and not overwrite:
        raise DataError(
            f"'{path}' already exists; pass --force to replace it, or choose another {option}"
        )


def partial_name(final: Path) -> Path:
    """The temporary name of ``final`` for this process: hidden, and never a dataset name."""
    return final.parent / f".{final.name}{_PARTIAL}{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(final: Path) -> None:
    """Leftovers of killed runs (their process is gone) for the same output."""
    for path in final.parent.glob(f".{final.name}{_PARTIAL}*"):
        pid_text = path.name.rsplit(_PARTIAL, 1)[1].split(".", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            remove_path(path)


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def make_folder(folder: Path) -> list[Path]:
    """Create ``folder`` with its missing parents; those it created, deepest first."""
    missing = [path for path in (folder, *folder.parents) if not path.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def remove_empty_folders(folders: list[Path]) -> None:
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()  # only if empty: a folder something else wrote into stays


@contextlib.contextmanager
def partial_paths(*finals: Path) -> Iterator[list[Path]]:
    """Temporary names for ``finals``; removed if the block fails (or is interrupted), and
    with them the output folders it created, so that a refused input writes nothing."""
    created: list[Path] = []
    for final in finals:
        created += make_folder(final.parent)
        remove_stale_partials(final)
    partials = [partial_name(final) for final in finals]
    finished = False
    try:
        yield partials
        finished = True
    finally:
        for partial in partials:
            remove_path(partial)  # after a successful commit nothing is left to remove
        if not finished:
            remove_empty_folders(created)


def commit_file(partial: Path, final: Path) -> None:
    os.replace(partial, final)


def commit_dataset(partial_prefix: Path, prefix: Path) -> None:
    """Move a finished dataset into place; the old index goes first, the new one last."""
    idx_path(prefix).unlink(missing_ok=True)
    _drop_megatron_cache(prefix)
    os.replace(bin_path(partial_prefix), bin_path(prefix))
    os.replace(meta_path(partial_prefix), meta_path(prefix))
    os.replace(idx_path(partial_prefix), idx_path(prefix))


def _drop_megatron_cache(prefix: Path) -> None:
    """Megatron caches sample indices under ``<prefix>/cache/`` keyed by settings, not by
    content; indices of the replaced data would be reused silently."""
    cache = Path(f"{prefix}") / "cache" / "GPTDataset_indices"
    if cache.is_dir():
        shutil.rmtree(cache, ignore_errors=True)
        for parent in (cache.parent, cache.parent.parent):
            with contextlib.suppress(OSError):
                parent.rmdir()  # only if empty
