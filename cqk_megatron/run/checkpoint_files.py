"""Checkpoint folders as files: manifests, verification, ``latest``, retention, and the
choice of where a run starts. Torch-free, so that the launcher checks a run's checkpoints
before it queues a job; ``cqk_megatron.training.checkpoint`` writes and reads them.

Rules that keep good state:

- a folder counts only if every file matches its ``manifest.json`` (written last);
- a run resumes from its newest such folder; folders newer than it (half-written,
  truncated) are moved to ``superseded/`` rather than overwritten later;
- when checkpoints exist but none verifies, the run stops and lists them: resuming from
  weights only (``weights:PATH``) or starting over (``none``) is the user's choice;
- retention deletes a folder only when ``keep_last`` newer folders verify by hash, and
  never the one just written; ``latest`` names a folder that verifies.
"""

from __future__ import annotations

import heapq
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cqk_megatron.config import ConfigError, RunConfig, load_config
from cqk_megatron.config.changes import (
    model_change_message,
    model_changes,
    shape_changes,
    shape_mismatch_message,
)
from cqk_megatron.errors import Refusal
from cqk_megatron.run import file_hash
from cqk_megatron.run.atomic import write_text_atomically
from cqk_megatron.run.file_hash import CHECKPOINT_HASH, HASHES
from cqk_megatron.run.folder import (
    CHECKPOINTS,
    CONFIG,
    HISTORY,
    METRICS,
    SUPERSEDED,
    WANDB_ID,
    supersede,
)

MANIFEST = "manifest.json"  # written last: the folder is whole
LATEST = "latest"  # in checkpoints/: the name of the newest complete folder
# What a weights-only resume reads: the layout-free weights and the trainer state.
WEIGHT_PARTS = ("model", "trainer", CONFIG, "layout.json")


class CheckpointError(Refusal, RuntimeError):
    """A checkpoint that is incomplete, corrupted or does not fit this run."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (a full disk, a lost lease); the previous one stands.
    ``disk_full``: its filesystem is full, so the run is refused (``refusals``): run again
    on the same disk, it would fail the same way. Otherwise a failure, not a refusal."""

    def __init__(self, message: str, disk_full: bool = False) -> None:
        super().__init__(message)
        self.disk_full = disk_full
        self.refuses = disk_full


def iteration_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"iter_{step:07d}"


def iteration_step(folder: Path) -> int | None:
    suffix = folder.name[len("iter_") :]
    return int(suffix) if folder.name.startswith("iter_") and suffix.isdigit() else None


def _step(folder: Path) -> int:
    """The step of an ``iter_NNNNNNN`` folder that ``iterations`` found."""
    step = iteration_step(folder)
    if step is None:
        raise ValueError(f"{folder} is not an iter_NNNNNNN checkpoint folder")
    return step


def iterations(checkpoints: Path) -> list[Path]:
    """``iter_NNNNNNN`` folders (not staging ``.tmp`` ones), oldest first."""
    if not checkpoints.is_dir():
        return []
    found = [p for p in checkpoints.iterdir() if p.is_dir() and iteration_step(p) is not None]
    return sorted(found, key=_step)


# -- manifest ------------------------------------------------------------------------------
#
# {"step": 100, "hash": "xxh3_128", "files": {"model/__0_0.distcp": {"size": 303735,
#  "xxh3_128": "..."}, ...}}. "hash" names the algorithm (``file_hash.HASHES``); a manifest
# without it was written with sha256 (each entry's "sha256"), and still verifies.

# How a folder's files are hashed against its manifest: ``(folder, algorithm, {name: (size,
# digest)})`` -> the first problem, or None. ``check_digests_here`` hashes them all in this
# process; ``training/checkpoint.py`` splits them across a job's ranks (``hash_share``).
HashCheck = Callable[[Path, str, dict[str, tuple[int, str]]], "str | None"]


def check_digests_here(
    folder: Path, algorithm: str, expected: dict[str, tuple[int, str]]
) -> str | None:
    for name in sorted(expected):
        path = folder / name
        if file_hash.file_digest(path, algorithm) != expected[name][1]:
            return f"{path}: contents do not match the manifest's {algorithm}"
    return None


def hash_share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` hashes when a folder is verified across ranks:
    the largest first, each to the rank with the fewest bytes so far (ties: the lowest
    rank), so every rank computes the same split and the slowest share stays near
    1/world of the bytes."""
    loads = [(0, r) for r in range(world)]
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, owner = heapq.heappop(loads)
        heapq.heappush(loads, (load + sizes[name], owner))
        if owner == rank:
            mine.append(name)
    return sorted(mine)


def write_manifest(
    folder: Path,
    step: int,
    with_hashes: bool,
    digests: dict[str, str] | None = None,
    algorithm: str = CHECKPOINT_HASH,
) -> None:
    """The manifest of every file in ``folder``, written last. ``digests`` ({name: digest
    under ``algorithm``}): files already hashed by the ranks that wrote them; the others
    are hashed here."""
    digests = digests or {}
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        name = str(path.relative_to(folder))
        entry: dict[str, int | str] = {"size": path.stat().st_size}
        if with_hashes:
            entry[algorithm] = digests.get(name) or file_hash.file_digest(path, algorithm)
        files[name] = entry
    record = {"step": step, **({"hash": algorithm} if with_hashes else {}), "files": files}
    write_text_atomically(folder / MANIFEST, json.dumps(record, indent=1))


def _in_parts(name: str, parts: tuple[str, ...] | None) -> bool:
    return parts is None or name.split("/", 1)[0] in parts


def _read_manifest(folder: Path) -> tuple[int, dict[str, Any], str]:
    """(step, files, hash algorithm) of ``folder``'s manifest."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST}, so the checkpoint was never completed")
    try:
        manifest = json.loads(manifest_path.read_text())
        files, step = manifest["files"], int(manifest["step"])
        algorithm = manifest.get("hash", "sha256")  # older manifests: sha256
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({error})") from error
    if algorithm not in HASHES:
        raise CheckpointError(
            f"{manifest_path}: hashed with {algorithm!r}, which this version does not read "
            f"({', '.join(HASHES)}); verify it with the version that wrote it"
        )
    return step, files, algorithm


def verify(
    folder: Path,
    hashes: bool = True,
    parts: tuple[str, ...] | None = None,
    hash_check: HashCheck | None = None,
) -> int:
    """The step of a complete checkpoint; raises ``CheckpointError`` saying what is wrong.

    ``hashes=False`` checks sizes only (cheap: the launcher's pre-flight); ``parts`` limits
    the check to files under those top-level names (``WEIGHT_PARTS``: a weights-only
    resume does not need the optimizer's files); ``hash_check`` hashes the files once
    every size matched (default: ``check_digests_here``).
    """
    step, files, algorithm = _read_manifest(folder)
    expected = {}
    for name, entry in files.items():
        if not _in_parts(name, parts):
            continue
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder}: {name} is listed in the manifest but missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"{path}: {size} bytes but the manifest says {entry['size']} (truncated?)"
            )
        if hashes and algorithm in entry:
            expected[name] = (size, entry[algorithm])
    if parts is not None and not any(_in_parts(name, ("model",)) for name in files):
        raise CheckpointError(f"{folder}: the manifest lists no model weights")
    problem = (hash_check or check_digests_here)(folder, algorithm, expected) if expected else None
    if problem is not None:
        raise CheckpointError(problem)
    return step


@dataclass
class Candidate:
    """One ``iter_*`` folder and what verification said of it."""

    folder: Path
    problem: str | None = None  # None: verifies
    weights_intact: bool = False  # model/ and trainer/ verify (the optimizer may not)

    @property
    def step(self) -> int:
        return _step(self.folder)


def survey(
    checkpoints: Path,
    hashes: bool = True,
    stop_at_good: bool = True,
    hash_check: HashCheck | None = None,
) -> list[Candidate]:
    """The folders newest first, each verified, until (and with) the first that verifies."""
    found = []
    for folder in reversed(iterations(checkpoints)):
        candidate = Candidate(folder)
        try:
            verify(folder, hashes, hash_check=hash_check)
            candidate.weights_intact = True
        except CheckpointError as error:
            candidate.problem = str(error)
            try:
                verify(folder, hashes, WEIGHT_PARTS, hash_check)
                candidate.weights_intact = True
            except CheckpointError:
                pass
        found.append(candidate)
        if candidate.problem is None and stop_at_good:
            break
    return found


def find_resumable(
    checkpoints: Path, hashes: bool = True, hash_check: HashCheck | None = None
) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint (or None) and why newer ones were refused."""
    found = survey(checkpoints, hashes, hash_check=hash_check)
    good = [c.folder for c in found if c.problem is None]
    return (good[0] if good else None), [c.problem for c in found if c.problem]


# -- latest and retention ------------------------------------------------------------------


def latest_name(checkpoints: Path) -> str | None:
    """The folder name ``latest`` holds (as written: it may name a folder gone since)."""
    path = checkpoints / LATEST
    if path.is_file():
        return path.read_text().strip() or None
    return None


def point_latest(checkpoints: Path, folder: Path) -> None:
    write_text_atomically(checkpoints / LATEST, folder.name + "\n")


def repoint_latest(checkpoints: Path) -> Path | None:
    """Point ``latest`` at the newest folder that verifies (sizes), or remove it."""
    for folder in reversed(iterations(checkpoints)):
        try:
            verify(folder, hashes=False)
        except CheckpointError:
            continue
        point_latest(checkpoints, folder)
        return folder
    (checkpoints / LATEST).unlink(missing_ok=True)
    return None


def retire(
    checkpoints: Path,
    keep: int,
    just_written: Path,
    hash_check: HashCheck | None = None,
    hashes: bool = True,
) -> list[Path]:
    """Delete folders older than the ``keep`` newest that verify, never ``just_written``
    (hashed as it was written). A folder counts only if its files match the manifest's
    hashes (``hashes=False``: sizes), so a newer folder with a flipped byte never lets an
    older good one go; while fewer than ``keep`` verify, nothing is deleted, and a folder
    newer than the oldest kept one is never deleted. Only when something could be deleted
    is anything hashed: the newest first, until ``keep`` verify. Returns what was deleted."""
    folders = iterations(checkpoints)
    if len([f for f in folders if f != just_written]) < keep:
        return []  # at most keep folders besides the new one: nothing to delete
    kept: list[Path] = []
    for folder in reversed(folders):
        if len(kept) == keep:
            break
        if folder == just_written:
            kept.append(folder)
            continue
        try:
            verify(folder, hashes, hash_check=hash_check)
            kept.append(folder)
        except CheckpointError:
            continue
    if len(kept) < keep:
        return []  # fewer good folders than keep_last: every one stays
    staying = set(kept) | {just_written}
    oldest_kept = min(_step(f) for f in staying)
    deleted = []
    for folder in folders:
        if folder not in staying and _step(folder) < oldest_kept:
            shutil.rmtree(folder, ignore_errors=True)
            deleted.append(folder)
    return deleted


def checkpoint_file(folder: Path) -> str | None:
    """What makes ``folder`` a checkpoint (its ``manifest.json``, or an ``iter_NNNNNNN``
    name, whole or half-written) or a checkpoints folder (``latest``, ``iter_*`` folders),
    or None. Tools that replace a folder refuse one where this is not None."""
    folder = Path(folder)
    if (folder / MANIFEST).is_file():
        return MANIFEST
    if iteration_step(Path(folder.name.removesuffix(".tmp"))) is not None:
        return f"the name {folder.name}"
    if (folder / LATEST).is_file():
        return LATEST
    if iterations(folder):
        return iterations(folder)[-1].name
    return None


def weights_only_checkpoint(folder: Path) -> bool:
    """``folder`` is a weights-only checkpoint (what ``cqk convert import`` and
    ``train.init_from`` write): its manifest lists weights, config and layout only, no
    trainer or optimizer state of a run."""
    try:
        files = json.loads((Path(folder) / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return bool(files) and all(_in_parts(name, ("model", CONFIG, "layout.json")) for name in files)


# -- config recorded with a checkpoint -------------------------------------------------------


def saved_config(folder: Path) -> RunConfig | None:
    """The config a checkpoint was saved with, if it recorded one that still loads."""
    path = folder / CONFIG
    if not path.is_file():
        return None
    try:
        return load_config(path)
    except ConfigError:
        return None


def check_same_shape(folder: Path, config: RunConfig, fix: str) -> None:
    """Refuse, naming the fields, a checkpoint whose recorded model has other shapes."""
    saved = saved_config(folder)
    if saved is None:
        return
    found = shape_changes(saved, config)
    if found:
        raise CheckpointError(shape_mismatch_message(f"checkpoint {folder}", found, fix))


def check_same_model(folder: Path, config: RunConfig, fix: str) -> None:
    """Refuse, naming the fields, a resume from a checkpoint whose recorded model computes
    another function (``changes.MODEL_KEYS``: its shapes, the coupling's steps, ...)."""
    saved = saved_config(folder)
    if saved is None:
        return
    found = model_changes(saved, config)
    if found:
        raise CheckpointError(model_change_message(f"checkpoint {folder}", found, fix))


# -- where a run starts -------------------------------------------------------------------------


@dataclass
class ResumeChoice:
    """Where a run starts: ``folder`` (None: from scratch) read ``exactly`` (weights,
    optimizer, RNG: same layout) or weights and trainer state only, and what to move out
    of the way first."""

    folder: Path | None = None
    weights_only: bool = False  # asked for: a fresh optimizer even in the same layout
    refused: list[str] = field(default_factory=list)  # newer folders that did not verify
    supersede: list[Path] = field(default_factory=list)  # moved to superseded/ first
    start_over: bool = False  # --resume none on a run with history: metrics move too


RESUME_HELP = (
    "auto: the newest complete checkpoint of the run, if any (the run stops if checkpoints "
    "exist but none verifies); none: start over (the run's checkpoints and metrics are "
    "moved to RUN/superseded/); weights:PATH: the weights and step of checkpoint PATH with "
    "a fresh optimizer (for a checkpoint whose optimizer files are damaged); PATH: that "
    "checkpoint"
)


def all_corrupt_message(checkpoints: Path, found: list[Candidate]) -> str:
    lines = [
        f"none of the {len(found)} checkpoint(s) in {checkpoints} verifies, so the run did "
        "not start and nothing was changed:"
    ]
    for candidate in found:
        intact = " [weights and trainer state intact]" if candidate.weights_intact else ""
        lines.append(f"  {candidate.folder.name}: {candidate.problem}{intact}")
    ways = []
    with_weights = [c for c in found if c.weights_intact]
    if with_weights:
        ways.append(
            f"resume from the weights of {with_weights[0].folder.name} (step "
            f"{with_weights[0].step}) with a fresh optimizer: --resume "
            f"weights:{with_weights[0].folder}"
        )
    ways.append(
        "start over: --resume none (the checkpoints and metrics are moved to "
        f"{checkpoints.parent / SUPERSEDED}/, not deleted)"
    )
    ways.append("or train it as a new run: name=OTHER_NAME")
    lines.append("ways on: " + "; ".join(ways))
    return "\n".join(lines)


def _newer_than(checkpoints: Path, step: int) -> list[Path]:
    return [f for f in iterations(checkpoints) if _step(f) > step]


def choose_resume(
    checkpoints: Path, resume: str, hashes: bool = True, hash_check: HashCheck | None = None
) -> ResumeChoice:
    """Read ``--resume`` (see ``RESUME_HELP``) against the run's checkpoints."""
    if resume == "none":
        return ResumeChoice(supersede=iterations(checkpoints), start_over=True)
    if resume == "auto":
        found = survey(checkpoints, hashes, hash_check=hash_check)
        if not found:
            return ResumeChoice()
        good = [c for c in found if c.problem is None]
        if not good:
            raise CheckpointError(all_corrupt_message(checkpoints, found))
        folder = good[0].folder
        refused = [c.problem for c in found if c.problem]
        return ResumeChoice(
            folder, refused=refused, supersede=_newer_than(checkpoints, good[0].step)
        )
    weights_only = resume.startswith("weights:")
    given = resume[len("weights:") :] if weights_only else resume
    if not given.strip():
        raise CheckpointError(
            f"--resume {resume!r} names no checkpoint; give its folder, e.g. --resume "
            f"{'weights:' if weights_only else ''}RUN/checkpoints/iter_0000100 (or --resume "
            "auto for the run's newest, none to start over)"
        )
    folder = Path(given).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"--resume {resume}: {folder} is not a checkpoint folder")
    step = verify(folder, hashes, WEIGHT_PARTS if weights_only else None, hash_check)
    inside = folder.resolve().parent == checkpoints.resolve()
    newer = _newer_than(checkpoints, step) if inside else []
    return ResumeChoice(folder, weights_only=weights_only, supersede=newer)


# The records of a run that ``--resume none`` moves to superseded/ (its checkpoints too).
STARTED_OVER = (METRICS, HISTORY, CONFIG, WANDB_ID)


def apply_choice(run_dir: Path, choice: ResumeChoice) -> str | None:
    """Move what the choice supersedes out of the way; a line saying where, if anything
    moved. Rank 0 only, before anything new is written."""
    paths = list(choice.supersede)
    if choice.start_over:  # a new run in the same folder: new records, a new wandb run
        paths += [run_dir / name for name in STARTED_OVER]
    moved = supersede(run_dir, paths)
    checkpoints = run_dir / CHECKPOINTS
    if checkpoints.is_dir():
        if choice.folder is not None and choice.folder.parent.resolve() == checkpoints.resolve():
            point_latest(checkpoints, choice.folder)
        else:
            repoint_latest(checkpoints)
    if moved is None:
        return None
    names = ", ".join(p.name for p in choice.supersede if p.name.startswith("iter_"))
    what = [f"checkpoint(s) {names}"] if names else []
    what += [name for name in STARTED_OVER if choice.start_over and (moved / name).exists()]
    return f"moved {' and '.join(what)} to {moved} (superseded, not deleted)"
