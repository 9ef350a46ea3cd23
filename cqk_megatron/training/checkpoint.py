"""Checkpoints that are complete or ignored, never half-read.

Layout of ``RUN/checkpoints/iter_0000100/``:

- ``model/``: the weights in Megatron's distributed format (``torch_dist``), loadable
  under any TP/PP layout;
- ``engine/``: the engine's optimizer state for this layout (DeepSpeed: one checkpoint per
  pipeline stage, ``engine/pp<stage>/ds``; Megatron: one distributed checkpoint);
- ``trainer/rank<r>.pt``: step, consumed samples, skipped-step counter, RNG states;
- ``config.yaml`` (the resolved run config) and ``layout.json``;
- ``manifest.json``: every file's size (and sha256), written last.

Everything is written under ``iter_0000100.tmp``; rank 0 writes the manifest and renames
the folder, then points ``latest`` at it (a temporary file renamed over the old one). A
folder without a valid manifest, or whose files disagree with it, is refused with the
reason, and ``find_resumable`` falls back to the previous complete checkpoint. The file
rules (verification, ``latest``, retention, where a run starts) live torch-free in
``cqk_megatron.checkpoint_files``; this module writes and reads the tensors.

A save is collective and fails on every rank together: each rank's error is gathered
before the next step, the half-written staging folder is removed (on a full disk that
frees the space the error message needs), and the previous checkpoint stays as it was.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from torch.distributed.checkpoint.api import CheckpointException

from cqk_megatron.atomic import write_text_atomically
from cqk_megatron.checkpoint_files import (
    LATEST,
    MANIFEST,
    WEIGHT_PARTS,
    CheckpointError,
    CheckpointSaveError,
    check_same_shape,
    find_resumable,
    iteration_dir,
    latest_name,
    point_latest,
    retire,
    saved_config,
    verify,
    write_manifest,
)
from cqk_megatron.config import RunConfig, save_config
from cqk_megatron.config_changes import changes, listed
from cqk_megatron.device import device
from cqk_megatron.model import load_sharded_state, sharded_state_dict
from cqk_megatron.parallel_plan import Layout, engine_name
from cqk_megatron.run_folder import CONFIG, is_no_space, no_space_error
from cqk_megatron.training.collectives import barrier, gather_objects
from cqk_megatron.training.engine import Engine

# torch.distributed.checkpoint reports a failed save or load as CheckpointException, which
# derives from BaseException (not Exception): caught explicitly, with everything else.
FAILURES = (Exception, CheckpointException)

__all__ = [
    "LATEST",
    "MANIFEST",
    "CheckpointError",
    "TrainerState",
    "find_resumable",
    "iteration_dir",
    "load_exact",
    "load_model_weights",
    "load_trainer_state",
    "same_layout",
    "save",
    "save_weights",
    "verify",
]


@dataclass
class TrainerState:
    step: int = 0
    consumed_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_in_a_row: int = 0
    tokens: int = 0


def current_layout(config: RunConfig) -> Layout:
    """The layout this process runs in, as a checkpoint records it."""
    return Layout(
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
        engine_name(config.train.engine, config.train.zero_stage),
    )


def _rng_state() -> dict:
    """Every generator a step can draw from: Python, NumPy, torch's CPU generator and, on
    GPU, this rank's CUDA generator and Megatron's CUDA RNG tracker (the model-parallel
    and data-parallel states that dropout inside tensor-parallel regions uses). All are
    host tensors, so the file loads anywhere."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    here = device()
    if here.type == "cuda":
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        state["cuda"] = torch.cuda.get_rng_state(here)
        tracked = get_cuda_rng_tracker().get_states()
        state["cuda_tracker"] = {name: s.clone() for name, s in tracked.items()}
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    here = device()
    if here.type == "cuda" and "cuda" in state:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        torch.cuda.set_rng_state(state["cuda"], here)
        if state.get("cuda_tracker"):
            get_cuda_rng_tracker().set_states(dict(state["cuda_tracker"]))


# -- save ------------------------------------------------------------------------------


def _agree(error: BaseException | None, staging: Path, what: str) -> None:
    """Collective: raise on every rank if any rank failed, after rank 0 removed the
    half-written ``staging`` folder (so a full disk has room for the message)."""
    local = None
    if error is not None:
        local = (
            str(no_space_error(staging, error, what))
            if is_no_space(error)
            else (f"{type(error).__name__}: {error}")
        )
    gathered = gather_objects(local)
    failures = [(rank, text) for rank, text in enumerate(gathered) if text is not None]
    if not failures:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    # a full disk explains the other ranks' errors; name it first
    failures.sort(key=lambda item: "no space left" not in item[1])
    rank, text = failures[0]
    if "no space left" in text:
        # the staging folder is gone now: say how much room that left
        text = str(no_space_error(staging, OSError(28, "No space left on device"), what))
    previous = (
        (staging.parent / LATEST).read_text().strip()
        if (staging.parent / LATEST).is_file()
        else None
    )
    kept = f"; the previous checkpoint {previous} is untouched" if previous else ""
    raise CheckpointSaveError(f"saving {what} failed on rank {rank}: {text}{kept}") from error


def _non_finite_parameters(model) -> list[str]:
    """This rank's parameters that hold inf or nan (ZeRO-3: its shard of each)."""
    named = [(name, getattr(p, "ds_tensor", p)) for name, p in model.named_parameters()]
    if not named:
        return []
    finite = torch.stack([torch.isfinite(t.detach()).all() for _, t in named]).cpu()
    return [name for (name, _), ok in zip(named, finite.tolist(), strict=True) if not ok]


def refuse_non_finite_weights(checkpoints: Path, model, step: int) -> None:
    """Collective, before a save writes anything: raise ``CheckpointSaveError`` on every
    rank if any rank's weights are not finite. Such a checkpoint would become ``latest``,
    and every resume would start from weights that can never train again."""
    gathered = gather_objects(_non_finite_parameters(model))
    bad = [(rank, names) for rank, names in enumerate(gathered) if names]
    if not bad:
        return
    rank, names = bad[0]
    previous = latest_name(checkpoints)
    kept = (
        f"the previous checkpoint {previous} stays latest"
        if previous
        else "the run has no earlier checkpoint"
    )
    raise CheckpointSaveError(
        f"not saving {iteration_dir(checkpoints, step).name}: the weights at step {step} are "
        f"not finite ({len(names)} parameter(s) with inf or nan on rank {rank}, e.g. "
        f"{names[0]}), so the run diverged; {kept}. Lower train.lr (or set train.clip_grad) "
        "and resume from it"
    )


def save(
    checkpoints: Path,
    engine: Engine,
    model,
    config: RunConfig,
    state: TrainerState,
    lease=None,
) -> Path:
    """Collective: every rank calls it. Returns the completed folder. ``lease`` (rank 0's
    ``run_lease.Lease``) is checked before the folder is committed."""
    refuse_non_finite_weights(checkpoints, model, state.step)
    rank = dist.get_rank()
    final = iteration_dir(checkpoints, state.step)
    staging = final.with_name(final.name + ".tmp")
    what = f"checkpoint {final}"
    error = None
    if rank == 0:
        try:
            shutil.rmtree(staging, ignore_errors=True)
            (staging / "model").mkdir(parents=True)
            (staging / "trainer").mkdir()
        except OSError as caught:
            error = caught
    _agree(error, staging, what)

    try:
        dist_checkpointing.save(sharded_state_dict(model), str(staging / "model"))
        engine.save_state(staging / "engine")
        trainer_file = staging / "trainer" / f"rank{rank}.pt"
        torch.save({"state": asdict(state), "rng": _rng_state()}, trainer_file)
    except FAILURES as caught:  # reported on every rank by _agree
        error = caught
    _agree(error, staging, what)

    if rank == 0:
        try:
            save_config(config, staging / CONFIG)
            layout = json.dumps(current_layout(config).checkpoint_record())
            write_text_atomically(staging / "layout.json", layout)
            write_manifest(staging, state.step, config.train.checkpoint_hashes)
            if lease is not None:
                lease.check()  # never commit into a run another job holds now
            if final.exists():
                shutil.rmtree(final)
            staging.rename(final)
            point_latest(checkpoints, final)
            retire(checkpoints, config.train.keep_last, final)
        except FAILURES as caught:
            error = caught
    _agree(error, staging, what)
    return final


# -- load ------------------------------------------------------------------------------


def _mismatch(folder: Path, config: RunConfig, error: BaseException, fix: str) -> CheckpointError:
    """A load that failed on tensor shapes, told in config fields where possible."""
    saved = saved_config(folder)
    text = str(error).strip().splitlines()
    mismatches = [line.strip() for line in text if "mismatch" in line.lower()]
    first = mismatches[0] if mismatches else (text[0] if text else "")
    first = re.sub(r"^[\w.]+(Exception|Error): ", "", first)  # the text, not the type
    if saved is not None:
        differ = [c for c in changes(saved, config) if c.key.startswith(("model.", "attention."))]
        if differ:
            return CheckpointError(
                f"checkpoint {folder} does not fit this model ({first}); its config.yaml "
                f"differs in {listed(differ)}; {fix}"
            )
    return CheckpointError(f"checkpoint {folder} does not fit this model ({first}); {fix}")


def load_model_weights(folder: Path, model, config: RunConfig | None = None, fix: str = "") -> None:
    """Weights from a distributed checkpoint, resharded to this rank's layout; only the
    weights and trainer state need to verify (a damaged optimizer does not matter here).
    With ``config``, a checkpoint of another shape is refused naming the fields.

    Call before the engine is built: ZeRO keeps its own fp32 master copy of the weights.
    """
    verify(folder, parts=WEIGHT_PARTS)
    fix = fix or "use a config with the checkpoint's values, or another checkpoint"
    if config is not None:
        check_same_shape(folder, config, fix)
    try:
        state = dist_checkpointing.load(sharded_state_dict(model), str(folder / "model"))
        load_sharded_state(model, state)
    except CheckpointError:
        raise
    except FAILURES as error:  # Megatron's shape errors, torch's size mismatches
        if config is None or "mismatch" not in str(error).lower():
            raise
        raise _mismatch(folder, config, error, fix) from error


def same_layout(folder: Path, config: RunConfig) -> bool:
    saved = Layout.from_checkpoint_record(json.loads((folder / "layout.json").read_text()))
    return saved == current_layout(config)


def load_trainer_state(folder: Path, rank: int = 0) -> tuple[TrainerState, dict]:
    # host tensors only (RNG states); map_location keeps a GPU-written file loadable anywhere
    path = folder / "trainer" / f"rank{rank}.pt"
    payload = torch.load(path, map_location="cpu", weights_only=False)
    return TrainerState(**payload["state"]), payload["rng"]


def load_exact(folder: Path, engine: Engine) -> TrainerState:
    """Collective, same layout: weights, optimizer, RNG and trainer state, bit for bit."""
    engine.load_state(folder / "engine", folder / "model")
    state, rng = load_trainer_state(folder, dist.get_rank())
    _set_rng_state(rng)
    return state


def save_weights(folder: Path, model, config: RunConfig) -> Path:
    """Collective: a weights-only checkpoint (``train.init_from`` reads it), atomic."""
    rank = dist.get_rank()
    staging = folder.with_name(folder.name + ".tmp")
    what = f"weights {folder}"
    error = None
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "model").mkdir(parents=True)
    barrier()
    try:
        dist_checkpointing.save(sharded_state_dict(model), str(staging / "model"))
    except FAILURES as caught:
        error = caught
    _agree(error, staging, what)
    if rank == 0:
        try:
            save_config(config, staging / CONFIG)
            layout = json.dumps(current_layout(config).checkpoint_record())
            write_text_atomically(staging / "layout.json", layout)
            write_manifest(staging, 0, config.train.checkpoint_hashes)
            if folder.exists():
                shutil.rmtree(folder)
            staging.rename(folder)
        except FAILURES as caught:
            error = caught
    _agree(error, staging, what)
    return folder
