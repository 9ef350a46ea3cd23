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
    "ResumePlan",
    "check_same_global_batch",
    "TrainerState",
    "find_resumable",
    "iteration_dir",
    "load_exact",
    "load_model_weights",
    "load_trainer_state",
    "resume_plan",
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
        with engine.whole_weights():  # ZeRO-3 partitions the parameters themselves
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


def saved_layout(folder: Path) -> Layout:
    """The layout checkpoint ``folder`` was saved under (its ``layout.json``)."""
    return Layout.from_checkpoint_record(json.loads((folder / "layout.json").read_text()))


def same_layout(folder: Path, config: RunConfig) -> bool:
    return saved_layout(folder) == current_layout(config)


@dataclass(frozen=True)
class ResumePlan:
    """How a checkpoint is read into this run, decided before the model is built.

    ``keeps_optimizer``: the engine loads its state (fp32 master weights, Adam moments,
    step counts), resharded when ``saved`` and ``current`` differ; otherwise the weights
    and trainer state are loaded and the optimizer starts fresh, for ``reason``."""

    saved: Layout
    current: Layout
    keeps_optimizer: bool
    reason: str = ""  # why the optimizer restarts (keeps_optimizer False)

    @property
    def exact(self) -> bool:
        return self.keeps_optimizer and self.saved == self.current

    def describe(self) -> str:
        """How the run resumes, for the line that says where it starts."""
        if self.exact:
            return "exactly"
        if self.keeps_optimizer:
            before, after = self.saved.describe_sizes(), self.current.describe_sizes()
            return f"optimizer state resharded from {before} to {after}"
        return f"weights only, fresh optimizer: {self.reason}"


def resume_plan(folder: Path, config: RunConfig, weights_only: bool = False) -> ResumePlan:
    """Whether the optimizer state of checkpoint ``folder`` comes back in this run's
    layout (each engine says where its format reshards), or why it restarts."""
    saved, current = saved_layout(folder), current_layout(config)
    if weights_only:
        return ResumePlan(saved, current, False, "as asked (--resume weights:PATH)")
    if saved == current:
        return ResumePlan(saved, current, True)
    if config.train.engine == "megatron":
        from cqk_megatron.training.megatron_engine import optimizer_restart_reason
    else:
        from cqk_megatron.training.deepspeed_engine import optimizer_restart_reason
    try:
        why = optimizer_restart_reason(saved, current, folder / "engine")
    except Exception as error:  # rank 0 decides for all: a damaged file must not stall them
        why = f"its optimizer state could not be read ({type(error).__name__}: {error})"
    if why is None:
        return ResumePlan(saved, current, True)
    change = (
        f"{saved.describe_sizes()} {saved.engine} -> {current.describe_sizes()} {current.engine}"
    )
    return ResumePlan(saved, current, False, f"the optimizer state cannot follow {change}: {why}")


def check_same_global_batch(folder: Path, config: RunConfig) -> None:
    """Refuse a resume whose global batch differs from the checkpoint's: the step count,
    the data position (consumed samples) and the optimizer's moments all assume it."""
    saved = saved_config(folder)
    if saved is None or saved.train.global_batch_size == config.train.global_batch_size:
        return
    old, new = saved.train.global_batch_size, config.train.global_batch_size
    raise CheckpointError(
        f"checkpoint {folder} was trained with train.global_batch_size={old}, this config "
        f"has {new}: a resume keeps the global batch, whatever the data-parallel size. "
        f"Set train.global_batch_size={old} (train.micro_batch_size x data-parallel size "
        "must divide it), or start a new run (another name=..., or --resume none)"
    )


def load_trainer_state(folder: Path, rank: int = 0) -> tuple[TrainerState, dict]:
    # host tensors only (RNG states); map_location keeps a GPU-written file loadable anywhere
    path = folder / "trainer" / f"rank{rank}.pt"
    payload = torch.load(path, map_location="cpu", weights_only=False)
    return TrainerState(**payload["state"]), payload["rng"]


def _saved_rank(saved: Layout) -> int | None:
    """The rank of the saved layout whose RNG this rank continues: the one at the same
    tensor- and pipeline-parallel position (data-parallel ranks beyond the saved size
    wrap around; their generators hold the same state unless dropout drew from them).
    None when TP or PP changed: no saved rank ran this rank's part of the model.
    Megatron's rank order (``tp-cp-ep-dp-pp``): rank = tp + TP * (dp + DP * pp)."""
    if (saved.tp, saved.pp) != (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
    ):
        return None
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    dp = ps.get_data_parallel_rank() % saved.dp
    return tp + saved.tp * (dp + saved.dp * pp)


def load_exact(folder: Path, engine: Engine, plan: ResumePlan | None = None) -> TrainerState:
    """Collective: weights, optimizer, RNG and trainer state. In the saved layout bit for
    bit; in another (``plan`` keeps the optimizer) the engine reshards its state, and the
    RNG comes from the saved rank at the same model-parallel position where there is one
    (``_saved_rank``; otherwise this rank keeps its seeded generators)."""
    engine.load_state(folder / "engine", folder / "model")
    if plan is None or plan.exact:
        state, rng = load_trainer_state(folder, dist.get_rank())
        _set_rng_state(rng)
        return state
    state, _ = load_trainer_state(folder)  # step and data position: the same on every rank
    source = _saved_rank(plan.saved)
    if source is not None:
        _set_rng_state(load_trainer_state(folder, source)[1])
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
