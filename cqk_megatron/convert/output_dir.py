"""An output folder that appears whole or not at all.

Files are written into a hidden staging folder beside the target; only a finished
folder is renamed into place, so a crash never leaves a half-written export that looks
like a good one. An existing target is refused unless ``overwrite``; then it is replaced
only after the new folder is complete. Even with ``overwrite``, a target that is, holds or
lies inside a run folder, a checkpoint or the conversion's own input is never replaced:
nothing of a run is deleted to make room for an export.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from cqk_megatron.convert.errors import ConversionError
from cqk_megatron.run.checkpoint_files import checkpoint_file
from cqk_megatron.run.folder import run_folder_file


def check_target(
    out_dir: Path,
    overwrite: bool,
    flag: str = "--force",
    inputs: Sequence[Path] = (),
    replaceable: Callable[[Path], bool] | None = None,
) -> None:
    """``out_dir`` may be written: it does not exist, or ``overwrite`` and it holds nothing
    of a run or of ``inputs`` (``replaceable(out_dir)``: what this tool itself writes, such
    as a weights-only checkpoint, may be replaced though it is a checkpoint)."""
    if out_dir.exists() and not overwrite:
        raise ConversionError(
            f"output folder '{out_dir}' already exists; choose a new folder or pass {flag} "
            "(overwrite=True) to replace it"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"output '{out_dir}' exists and is not a folder")
    if out_dir.exists():
        problem = _input_overlap(out_dir, inputs) or _run_state_around(out_dir, replaceable)
        if problem:
            raise ConversionError(
                f"{flag} would delete '{out_dir}', which {problem}; nothing was deleted. "
                "Write to a new folder outside every run folder (or remove that folder "
                "yourself if it really is to go)"
            )


def _input_overlap(out_dir: Path, inputs: Sequence[Path]) -> str | None:
    target = out_dir.resolve()
    for given in inputs:
        source = Path(given).resolve()
        if target == source:
            return "is the conversion's own input"
        if target in source.parents:
            return f"holds the conversion's input '{given}'"
        if source in target.parents:
            return f"is inside the conversion's input '{given}'"
    return None


def _run_state(folder: Path) -> str | None:
    """What marks ``folder`` as a checkpoint or a run folder, in words; None if nothing."""
    if (found := checkpoint_file(folder)) is not None:
        return f"a checkpoint (it has {found})"
    if (found := run_folder_file(folder)) is not None:
        return f"a run folder (it has {found})"
    return None


def _run_state_around(out_dir: Path, replaceable: Callable[[Path], bool] | None) -> str | None:
    """Whether ``out_dir`` is, lies inside or holds a run folder or a checkpoint."""
    target = out_dir.resolve()
    if (found := _run_state(target)) and not (replaceable and replaceable(target)):
        return f"is {found}"
    for parent in target.parents:
        if found := _run_state(parent):
            return f"is inside '{parent}', {found}"
    for folder, subfolders, _ in os.walk(target):
        for name in subfolders:
            if found := _run_state(Path(folder, name)):
                return f"holds '{Path(folder, name)}', {found}"
    return None


@contextlib.contextmanager
def staged_folder(
    out_dir: Path,
    overwrite: bool,
    inputs: Sequence[Path] = (),
    replaceable: Callable[[Path], bool] | None = None,
) -> Iterator[Path]:
    """Yield a staging folder; on success it becomes ``out_dir``, on error it is removed.
    ``inputs``, ``replaceable``: as for ``check_target``."""
    out_dir = Path(out_dir)
    check_target(out_dir, overwrite, inputs=inputs, replaceable=replaceable)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.chmod(0o755)  # mkdtemp makes it private
    if out_dir.exists():
        check_target(out_dir, overwrite, inputs=inputs, replaceable=replaceable)  # appeared
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        old.rmdir()
        out_dir.rename(old)
        staging.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(out_dir)
