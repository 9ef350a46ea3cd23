"""Pre-flight: what can be checked from files before a job is queued or a process group is
built. ``launch/submit.py`` runs it for every run it is about to submit, ``cqk train``
before it starts training; each refusal is one ``PreflightError`` line (exit 2).

1. the data: prefixes, indexes, ``.bin`` sizes, tokenizer against ``model.vocab_size``,
   splits against ``model.seq_length`` (``cqk_megatron.data.checks``);
2. the run folder: a live holder of its lease; its recorded ``config.yaml`` against this
   config (changes that keep the model's function are listed, and the run's history
   records them; a change of what the model computes, ``changes.MODEL_KEYS``, is refused
   unless the run starts over, ``--resume none``); its checkpoints (refused if some exist
   and none verifies; the launcher verifies by hash, as the job will, and names the one
   the run resumes from);
3. the disk: room for one checkpoint, estimated from the model's parameter count
   (``params.total_parameters``) and the precision.

Torch-free: nothing here imports Megatron.
"""

from __future__ import annotations

from pathlib import Path

from cqk_megatron.config import ConfigError, RunConfig, load_config
from cqk_megatron.config.changes import (
    LOCATION_KEYS,
    changes,
    kept_function_changes,
    listed,
    model_change_message,
    model_changes,
    new_run_fix,
)
from cqk_megatron.data.checks import check_run_data
from cqk_megatron.data.errors import DataError
from cqk_megatron.model.params import total_parameters
from cqk_megatron.perf.memory import BYTES
from cqk_megatron.run import checkpoint_files
from cqk_megatron.run import lease as run_lease
from cqk_megatron.run.folder import (
    CHECKPOINTS,
    CONFIG,
    HISTORY,
    SUPERSEDED,
    run_dir_of,
    run_status,
)
from cqk_megatron.run.unwritable import free_bytes, human_bytes, unwritable_folder

OPTIMIZER_BYTES_PER_PARAMETER = 12  # fp32 master weights + Adam's two fp32 moments


class PreflightError(ConfigError):
    """A run that would fail: the message is one line naming the file or field and the fix."""


def checkpoint_bytes(config: RunConfig) -> int:
    """Estimated size of one checkpoint: the weights twice (the layout-free ``model/`` and
    the engine's own copy) and the optimizer's fp32 state: a master copy and two Adam
    moments, which ZeRO and Megatron's distributed optimizer save even for fp32 training
    (about 2.6 MB for the 123k-parameter test model, 2.5 MB estimated)."""
    parameters = total_parameters(config)
    return parameters * (2 * BYTES[config.train.precision] + OPTIMIZER_BYTES_PER_PARAMETER)


def check_disk(config: RunConfig) -> None:
    """The run folder's filesystem takes writes (it is not read-only) and holds one
    checkpoint."""
    run_dir = run_dir_of(config)
    unwritable = unwritable_folder(run_dir)
    if unwritable is not None:  # the message a write there would meet (``run.folder``)
        raise PreflightError(str(unwritable))
    need = checkpoint_bytes(config)
    free = free_bytes(run_dir)
    if free < need:
        raise PreflightError(
            f"not enough disk for one checkpoint of run '{config.name}': it needs about "
            f"{human_bytes(need)} ({total_parameters(config):,} parameters, "
            f"{config.train.precision}) and the filesystem of {run_dir} has "
            f"{human_bytes(free)} free; free space there or set log.root to a larger one"
        )


def check_run_folder(
    config: RunConfig, resume: str = "auto", hash_checkpoints: bool = False
) -> list[str]:
    """The run folder can take this run; notes on what changed since it last started and
    on the checkpoint it resumes from."""
    run_dir = run_dir_of(config)
    holder = run_lease.live_holder(run_dir)
    if holder is not None:
        raise PreflightError(run_lease.held_message(run_dir, holder))
    notes = []
    recorded_path = run_dir / CONFIG
    if recorded_path.is_file():
        try:
            recorded = load_config(recorded_path)
        except ConfigError as error:
            raise PreflightError(
                f"{recorded_path} (the run's recorded config) does not load: {error}; move the "
                "run folder aside or fix the file"
            ) from error
        models = model_changes(recorded, config)
        if models and resume != "none":
            saved = checkpoint_files.iterations(run_dir / CHECKPOINTS)
            fix = new_run_fix(config.name, str(saved[-1]) if saved else "CHECKPOINT")
            raise PreflightError(
                model_change_message(f"run folder {run_dir}", models, fix)
                + " (its checkpoints and records are moved to superseded/)"
            )
        other = kept_function_changes(recorded, config)
        if other:
            notes.append(
                f"note: run '{config.name}' continues with changed settings: {listed(other)} "
                f"(recorded in {HISTORY} with the step they take effect)"
            )
    hashes = hash_checkpoints and config.train.checkpoint.hashes  # as the job will
    notes += _check_checkpoints(run_dir / CHECKPOINTS, resume, hashes)
    return notes


def finished_message(config: RunConfig, resume: str = "auto") -> str | None:
    """The line that says a run has nothing to train (None when it has): it finished all
    of this config's ``train.train_steps``. Such a run trains nothing and changes nothing,
    whatever else this config changes (``--resume none`` starts it over instead)."""
    run_dir = run_dir_of(config)
    if resume == "none" or not run_status(run_dir, config.train.train_steps).finished:
        return None
    line = (
        f"run '{config.name}' finished all {config.train.train_steps} steps in {run_dir}: "
        "nothing to train, nothing changed"
    )
    recorded = _recorded_config(run_dir / CONFIG)
    differ = [] if recorded is None else changes(recorded, config)
    differ = [c for c in differ if c.key not in LOCATION_KEYS]
    if differ:
        line += (
            f"; these settings were not applied: {listed(differ)}. Train them as a new run "
            "(another name=...), or raise train.train_steps to continue this one"
        )
    return line


def _recorded_config(path: Path) -> RunConfig | None:
    try:
        return load_config(path) if path.is_file() else None
    except ConfigError:
        return None


def _check_checkpoints(checkpoints: Path, resume: str, hashes: bool) -> list[str]:
    """The resume's own choice (``checkpoint_files.choose_resume``), made from the files:
    with ``hashes`` it agrees with the job's, which verifies the same way."""
    try:
        choice = checkpoint_files.choose_resume(checkpoints, resume, hashes)
    except checkpoint_files.CheckpointError as error:
        raise PreflightError(str(error)) from error
    notes = [f"note: skipping checkpoint: {reason}" for reason in choice.refused]
    if choice.refused and choice.folder is not None:
        checked = "verified by hash" if hashes else "sizes checked"
        notes.append(
            f"note: resuming from {choice.folder.name} (the newest that verifies, {checked}); "
            f"the job moves the newer one(s) to {checkpoints.parent / SUPERSEDED}/"
        )
    return notes


def preflight(config: RunConfig, resume: str = "auto", hash_checkpoints: bool = False) -> list[str]:
    """Refuse (``PreflightError``) a run that cannot start; else notes to print.

    ``hash_checkpoints``: verify the checkpoint the run would resume from by its hashes
    (``train.checkpoint.hashes``), as the job does, so that a damaged one is named here
    (the run resumes from the newest that verifies, or is refused when none does) rather
    than after the job waited in the queue. The launcher asks for it: it reads the
    checkpoint once, newest first, until one verifies (about a second per GB). ``cqk train``
    does not: its rank 0 verifies the same way a moment later, and every rank runs this.
    """
    try:
        check_run_data(config)
    except (DataError, ConfigError) as error:
        raise PreflightError(str(error)) from error
    notes = check_run_folder(config, resume, hash_checkpoints)
    check_disk(config)
    return notes
