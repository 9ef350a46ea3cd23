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
reason, and ``find_resumable`` falls back to the previous complete checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps

from cqk_megatron.config import RunConfig, save_config
from cqk_megatron.device import device
from cqk_megatron.model import load_sharded_state, sharded_state_dict
from cqk_megatron.training.collectives import barrier

MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupted or does not fit this run."""


@dataclass
class TrainerState:
    step: int = 0
    consumed_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_in_a_row: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class Layout:
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    engine: str
    zero_stage: int

    @classmethod
    def current(cls, config: RunConfig) -> Layout:
        return cls(
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_data_parallel_world_size(),
            config.train.engine,
            config.train.zero_stage,
        )


def iteration_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"iter_{step:07d}"


# -- manifest ------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path, step: int, with_hashes: bool) -> None:
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        entry = {"size": path.stat().st_size}
        if with_hashes:
            entry["sha256"] = _sha256(path)
        files[str(path.relative_to(folder))] = entry
    temporary = folder / (MANIFEST + ".tmp")
    temporary.write_text(json.dumps({"step": step, "files": files}, indent=1))
    os.replace(temporary, folder / MANIFEST)


def verify(folder: Path) -> int:
    """The step of a complete checkpoint; raises ``CheckpointError`` saying what is wrong."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST}, so the checkpoint was never completed")
    try:
        manifest = json.loads(manifest_path.read_text())
        files, step = manifest["files"], int(manifest["step"])
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({error})") from error
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder}: {name} is listed in the manifest but missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"{path}: {size} bytes but the manifest says {entry['size']} (truncated?)"
            )
        if "sha256" in entry and _sha256(path) != entry["sha256"]:
            raise CheckpointError(f"{path}: contents do not match the manifest's sha256")
    return step


def find_resumable(checkpoints: Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint (or None) and why newer ones were refused."""
    refused = []
    if not checkpoints.is_dir():
        return None, refused
    candidates = sorted(
        (p for p in checkpoints.glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp")),
        reverse=True,
    )
    for folder in candidates:
        try:
            verify(folder)
            return folder, refused
        except CheckpointError as error:
            refused.append(str(error))
    return None, refused


# -- save ------------------------------------------------------------------------------


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


def save(checkpoints: Path, engine, model, config: RunConfig, state: TrainerState) -> Path:
    """Collective: every rank calls it. Returns the completed folder."""
    rank = dist.get_rank()
    final = iteration_dir(checkpoints, state.step)
    staging = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "model").mkdir(parents=True)
        (staging / "trainer").mkdir()
    barrier()

    dist_checkpointing.save(sharded_state_dict(model), str(staging / "model"))
    engine.save_state(staging / "engine")
    trainer_file = staging / "trainer" / f"rank{rank}.pt"
    torch.save({"state": asdict(state), "rng": _rng_state()}, trainer_file)
    barrier()

    if rank == 0:
        save_config(config, staging / "config.yaml")
        (staging / "layout.json").write_text(json.dumps(asdict(Layout.current(config))))
        write_manifest(staging, state.step, config.train.checkpoint_hashes)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        _point_latest(checkpoints, final)
        _keep_last(checkpoints, config.train.keep_last)
    barrier()
    return final


def _point_latest(checkpoints: Path, folder: Path) -> None:
    temporary = checkpoints / (LATEST + ".tmp")
    temporary.write_text(folder.name + "\n")
    os.replace(temporary, checkpoints / LATEST)


def _keep_last(checkpoints: Path, keep: int) -> None:
    complete = sorted(p for p in checkpoints.glob("iter_*") if (p / MANIFEST).is_file())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


# -- load ------------------------------------------------------------------------------


def load_model_weights(folder: Path, model) -> None:
    """Weights from a verified distributed checkpoint, resharded to this rank's layout.

    Call before the engine is built: ZeRO keeps its own fp32 master copy of the weights.
    """
    verify(folder)
    state = dist_checkpointing.load(sharded_state_dict(model), str(folder / "model"))
    load_sharded_state(model, state)


def same_layout(folder: Path, config: RunConfig) -> bool:
    saved = Layout(**json.loads((folder / "layout.json").read_text()))
    return saved == Layout.current(config)


def load_trainer_state(folder: Path, rank: int = 0) -> tuple[TrainerState, dict]:
    # host tensors only (RNG states); map_location keeps a GPU-written file loadable anywhere
    path = folder / "trainer" / f"rank{rank}.pt"
    payload = torch.load(path, map_location="cpu", weights_only=False)
    return TrainerState(**payload["state"]), payload["rng"]


def load_exact(folder: Path, engine) -> TrainerState:
    """Collective, same layout: weights, optimizer, RNG and trainer state, bit for bit."""
    engine.load_state(folder / "engine", folder / "model")
    state, rng = load_trainer_state(folder, dist.get_rank())
    _set_rng_state(rng)
    return state


def save_weights(folder: Path, model, config: RunConfig) -> Path:
    """Collective: a weights-only checkpoint (``train.init_from`` reads it), atomic."""
    rank = dist.get_rank()
    staging = folder.with_name(folder.name + ".tmp")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "model").mkdir(parents=True)
    barrier()
    dist_checkpointing.save(sharded_state_dict(model), str(staging / "model"))
    barrier()
    if rank == 0:
        save_config(config, staging / "config.yaml")
        (staging / "layout.json").write_text(json.dumps(asdict(Layout.current(config))))
        write_manifest(staging, 0, config.train.checkpoint_hashes)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
    barrier()
    return folder
