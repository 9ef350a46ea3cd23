"""An output folder that appears whole or not at all.

Files are written into a hidden staging folder beside the target; only a finished
folder is renamed into place, so a crash never leaves a half-written export that looks
like a good one. An existing target is refused unless ``overwrite``; then it is replaced
only after the new folder is complete.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from cqk_megatron.convert.errors import ConversionError


def check_target(out_dir: Path, overwrite: bool, flag: str = "--overwrite") -> None:
    if out_dir.exists() and not overwrite:
        raise ConversionError(
            f"output folder '{out_dir}' already exists; choose a new folder or pass {flag} "
            "(overwrite=True) to replace it"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"output '{out_dir}' exists and is not a folder")


@contextlib.contextmanager
def staged_folder(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a staging folder; on success it becomes ``out_dir``, on error it is removed."""
    out_dir = Path(out_dir)
    check_target(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.chmod(0o755)  # mkdtemp makes it private
    if out_dir.exists():
        check_target(out_dir, overwrite)  # appeared meanwhile
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        old.rmdir()
        out_dir.rename(old)
        staging.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(out_dir)
