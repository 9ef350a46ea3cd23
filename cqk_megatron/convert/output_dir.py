"""An output folder that appears whole or not at all.

Files are written into a hidden staging folder beside the target; only a finished
folder is renamed into place, so a crash never leaves a half-written export that looks
like a good one. An existing target is refused unless ``overwrite``; then it is replaced
only after the new folder is complete. Even with ``overwrite``, a target that is, holds or
lies inside a run folder, a checkpoint or the conversion's own input is never replaced:
nothing of a run is deleted to make room for an export. Nor is anything else that the same
command did not write there: a finished folder records its files and the command that
wrote them (``OUTPUT_MANIFEST``), and ``overwrite`` replaces a folder only when every file
in it is one it lists (or it is empty). A dataset, a tokenizer or a folder of unknown files
at a mistyped path is refused, named, and left as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from cqk_megatron.convert.errors import ConversionError
from cqk_megatron.run.checkpoint_files import MANIFEST, checkpoint_file
from cqk_megatron.run.folder import run_folder_file

OUTPUT_MANIFEST = ".cqk-output.json"  # {"written_by": command, "files": [relative paths]}
EXPORT = "cqk convert export"
_SHOWN = 3  # file names shown per kind in a refusal


def check_target(
    out_dir: Path,
    overwrite: bool,
    flag: str = "--force",
    inputs: Sequence[Path] = (),
    replaceable: Callable[[Path], bool] | None = None,
    command: str = EXPORT,
) -> None:
    """``out_dir`` may be written: it does not exist, or ``overwrite`` and it holds nothing
    of a run or of ``inputs``, and nothing that ``command`` did not write there before (its
    ``OUTPUT_MANIFEST``; ``replaceable(out_dir)``: what this tool itself writes, such as a
    weights-only checkpoint, may be replaced though it is a checkpoint, when its own
    manifest lists every file in it)."""
    if out_dir.exists() and not overwrite:
        raise ConversionError(
            f"output folder '{out_dir}' already exists; choose a new folder or pass {flag} "
            "(overwrite=True) to replace it"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"output '{out_dir}' exists and is not a folder")
    if out_dir.exists():
        problem = (
            _input_overlap(out_dir, inputs)
            or _run_state_around(out_dir, replaceable)
            or _foreign_files(out_dir, command, replaceable)
        )
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


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


def _listed_files(folder: Path, command: str, replaceable: Callable[[Path], bool] | None):
    """The files ``command`` recorded writing into ``folder`` (with their record); None
    where no record of it is there."""
    if replaceable is not None and replaceable(folder):
        record, key = folder / MANIFEST, "files"
    else:
        record, key = folder / OUTPUT_MANIFEST, "files"
    try:
        data = json.loads(record.read_text())
        listed = set(data[key])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if record.name == OUTPUT_MANIFEST and data.get("written_by") != command:
        return None
    return listed | {record.name}


def _foreign_files(
    out_dir: Path, command: str, replaceable: Callable[[Path], bool] | None
) -> str | None:
    """What in ``out_dir`` is not the earlier output of ``command``, in words; None if
    nothing (an empty folder, or one whose every file its record lists)."""
    found = _files(out_dir)
    listed = _listed_files(out_dir, command, replaceable)
    foreign = [name for name in found if listed is None or name not in listed]
    if not foreign:
        return None
    whose = f"no earlier {command}" if listed is None else f"the earlier {command} there"
    return f"holds {len(foreign)} file(s) that {whose} wrote: {describe_files(foreign)}"


def describe_files(names: list[str]) -> str:
    """Files by what they look like: a dataset, a tokenizer, other files (a few named)."""
    kinds: dict[str, list[str]] = {}
    for name in names:
        kinds.setdefault(_kind_of_file(name), []).append(name)
    parts = []
    for kind, members in kinds.items():
        shown = ", ".join(members[:_SHOWN]) + (
            f", +{len(members) - _SHOWN} more" * (len(members) > _SHOWN)
        )
        parts.append(f"{kind} ({shown})")
    return "; ".join(parts)


def _kind_of_file(name: str) -> str:
    base = Path(name).name
    if base.endswith((".bin", ".idx", ".meta.json")):
        return "a dataset"
    if base.endswith((".model", ".vocab")) or base in ("tokenizer.json", "tokenizer_config.json"):
        return "a tokenizer"
    return "other files"


def write_output_record(folder: Path, command: str) -> None:
    """Record in ``folder`` the files ``command`` wrote there (so that a later ``--force``
    knows them from anything else)."""
    record = {"written_by": command, "files": _files(folder)}
    (folder / OUTPUT_MANIFEST).write_text(json.dumps(record, indent=1) + "\n")


@contextlib.contextmanager
def staged_folder(
    out_dir: Path,
    overwrite: bool,
    inputs: Sequence[Path] = (),
    replaceable: Callable[[Path], bool] | None = None,
    command: str = EXPORT,
) -> Iterator[Path]:
    """Yield a staging folder; on success it becomes ``out_dir``, recording what
    ``command`` wrote, on error it is removed. ``inputs``, ``replaceable``: as for
    ``check_target``."""
    out_dir = Path(out_dir)
    guard = {"inputs": inputs, "replaceable": replaceable, "command": command}
    check_target(out_dir, overwrite, **guard)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        yield staging
        write_output_record(staging, command)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.chmod(0o755)  # mkdtemp makes it private
    if out_dir.exists():
        check_target(out_dir, overwrite, **guard)  # appeared meanwhile
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        old.rmdir()
        out_dir.rename(old)
        staging.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(out_dir)
