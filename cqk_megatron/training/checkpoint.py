"""Checkpoints that are complete or ignored, never half-read.

Files of ``RUN/checkpoints/iter_0000100/``:

- ``model/``: the weights in Megatron's distributed format (``torch_dist``), loadable
  under any TP/PP layout;
- ``engine/``: the engine's optimizer state for this layout (DeepSpeed: one checkpoint per
  pipeline stage, ``engine/pp<stage>/ds``; Megatron: one distributed checkpoint);
- ``trainer/rank<r>.pt``: step, consumed samples, skipped-step counter, RNG states;
- ``config.yaml`` (the resolved run config) and ``layout.json``;
- ``manifest.json``: every file's size (and xxh3-128 digest), written last.

Everything is written under ``iter_0000100.tmp``. Each rank hashes the files it wrote, all
ranks at once, and rank 0 gathers the digests into the manifest, renames the folder, then
points ``latest`` at it (a temporary file renamed over the old one). Verifying a folder
(at resume, before retention deletes anything) splits its files across the ranks the same
way (``rank0_with_hash_helpers``). A
folder without a valid manifest, or whose files disagree with it, is refused with the
reason, and ``find_resumable`` falls back to the previous complete checkpoint. The file
rules (verification, ``latest``, retention, where a run starts) live torch-free in
``cqk_megatron.run.checkpoint_files``; this module writes and reads the tensors.

A save is collective and fails on every rank together: each rank's error is gathered
after each part (the weights, the engine's state, the trainer state) and before the
commit, the half-written staging folder is removed (on a full disk that frees the space
the error message needs), and the previous checkpoint stays as it was. A write that fails
inside Megatron's or DeepSpeed's own collective save is held until the library's call
returns (``guarded_writes``), so that no rank waits in a collective its peer left.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from torch.distributed.checkpoint.api import CheckpointException

from cqk_megatron.compat import save_writes
from cqk_megatron.config import RunConfig, save_config
from cqk_megatron.config.changes import changes, listed
from cqk_megatron.model.gpt import load_sharded_state, sharded_state_dict
from cqk_megatron.parallel.device import device
from cqk_megatron.parallel.layout import Layout
from cqk_megatron.run import file_hash
from cqk_megatron.run.atomic import write_text_atomically
from cqk_megatron.run.checkpoint_files import (
    LATEST,
    MANIFEST,
    WEIGHT_PARTS,
    CheckpointError,
    CheckpointSaveError,
    HashCheck,
    check_digests_here,
    check_same_shape,
    find_resumable,
    hash_share,
    iteration_dir,
    iteration_step,
    latest_name,
    point_latest,
    retire,
    saved_config,
    verify,
    write_manifest,
)
from cqk_megatron.run.folder import CONFIG
from cqk_megatron.run.unwritable import is_unwritable, names_unwritable, no_space_error
from cqk_megatron.training.collectives import (
    from_rank0,
    gather_objects,
    gather_objects_on_rank0,
)
from cqk_megatron.training.engines import engine_class, engine_of
from cqk_megatron.training.engines.protocol import Engine

# torch.distributed.checkpoint reports a failed save or load as CheckpointException, which
# derives from BaseException (not Exception): caught explicitly, with everything else.
FAILURES = (Exception, CheckpointException)
T = TypeVar("T")

__all__ = [
    "LATEST",
    "MANIFEST",
    "CheckpointError",
    "ResumeMode",
    "check_same_global_batch",
    "TrainerState",
    "find_resumable",
    "iteration_dir",
    "load_exact",
    "load_model_weights",
    "load_trainer_state",
    "resume_mode",
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
    # The state of the callbacks a caller of ``loop.train`` adds, by ``Callback.state_key``
    # (host objects only: a checkpoint written on GPU loads anywhere).
    callbacks: dict[str, Any] = field(default_factory=dict)


def current_layout(config: RunConfig) -> Layout:
    """The layout this process runs in, as a checkpoint records it."""
    return Layout(
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
        engine_of(config).sharding_at(config.train.zero_stage),
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
    half-written ``staging`` folder (so a full disk has room for the message). A full disk
    raises with ``disk_full`` set: the run is refused, not relaunched into the same disk."""
    local = None
    if error is not None:
        local = (
            str(no_space_error(staging, error, what))
            if is_unwritable(error)
            else (f"{type(error).__name__}: {error}")
        )
    gathered = gather_objects(local)
    failures = [(rank, text) for rank, text in enumerate(gathered) if text is not None]
    if not failures:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    # a full disk (or a read-only one) explains the other ranks' errors; name it first
    failures.sort(key=lambda item: not names_unwritable(item[1]))
    rank, text = failures[0]
    disk_full = names_unwritable(text)
    if text.startswith("no space left"):
        # the staging folder is gone now: say how much room that left
        text = str(no_space_error(staging, OSError(28, "No space left on device"), what))
    previous = (
        (staging.parent / LATEST).read_text().strip()
        if (staging.parent / LATEST).is_file()
        else None
    )
    kept = f"; the previous checkpoint {previous} is untouched" if previous else ""
    raise CheckpointSaveError(
        f"saving {what} failed on rank {rank}: {text}{kept}", disk_full=disk_full
    ) from error


class WriteLog:
    """What one rank's file writes did during a save: the files written (this rank hashes
    them for the manifest) and the first write that failed."""

    def __init__(self) -> None:
        self.paths: list[Path] = []
        self.error: BaseException | None = None

    def attempt(self, write: Callable[[], object]) -> BaseException | None:
        """``write()`` with its file writes guarded (``guarded_writes``): the first
        failure, raised or deferred, or None (the paths written add up over attempts)."""
        self.error = None
        try:
            with guarded_writes(self):
                write()
        except FAILURES as caught:
            self.error = self.error or caught
        return self.error


def _guarded(log: WriteLog, write: Callable, target: Callable[..., object]) -> Callable:
    """``write`` (a file-writing function) recording the path ``target(*args, **kwargs)``
    names, and on the main thread of this process deferring its failure to ``log``."""
    pid, main = os.getpid(), threading.main_thread()

    def guarded(*args, **kwargs):
        path = target(*args, **kwargs)
        if path is None or os.getpid() != pid or threading.current_thread() is not main:
            return write(*args, **kwargs)  # a stream, or a writer's helper: as it was
        if log.error is not None:
            return None  # this rank's save has failed: write nothing more
        try:
            result = write(*args, **kwargs)
        except FAILURES as caught:
            log.error = caught
            return None
        log.paths.append(Path(path))
        return result

    return guarded


@contextlib.contextmanager
def guarded_writes(log: WriteLog):
    """During a collective save by Megatron-Core or DeepSpeed, a rank whose file write
    fails (a full disk) must not raise there: its peers would wait in the library's next
    collective (DeepSpeed's closing barrier) while it waits in ``_agree``, and the job
    would hang until a timeout. So the failure is kept in ``log``, this rank writes
    nothing more and goes through the library's remaining collectives with the others,
    and the error is raised after the call, on the way to ``_agree``. The written paths
    are recorded too: each rank hashes the files it wrote. Only this process's main
    thread is guarded (Megatron's writer threads and processes report their own errors,
    which it agrees across ranks itself)."""
    with save_writes.replaced(lambda write, path_of: _guarded(log, write, path_of)):
        yield log
        if log.error is not None:
            raise log.error


def _own_files(staging: Path, log: WriteLog, rank: int) -> list[str]:
    """The files of ``staging`` this rank wrote: through the guarded writes, and its
    shards of each distributed checkpoint (torch DCP names them ``__<rank>_<n>.distcp``)."""
    names = {str(p.relative_to(staging)) for p in log.paths if p.is_relative_to(staging)}
    names |= {str(p.relative_to(staging)) for p in staging.rglob(f"__{rank}_*.distcp")}
    return sorted(n for n in names if (staging / n).is_file())


def own_digests(staging: Path, log: WriteLog, rank: int | None = None) -> dict[str, str]:
    """This rank's digests of the files it wrote, by name within ``staging`` (``rank``
    given where no process group may be used: a checkpoint writer's process)."""
    names = _own_files(staging, log, dist.get_rank() if rank is None else rank)
    algorithm = file_hash.CHECKPOINT_HASH
    return {n: file_hash.file_digest(staging / n, algorithm) for n in names}


def _hash_own_files(
    staging: Path, log: WriteLog, with_hashes: bool
) -> tuple[dict[str, str], BaseException | None]:
    """This rank's digests of the files it wrote ({} without hashes), or the error."""
    if not with_hashes:
        return {}, None
    try:
        return own_digests(staging, log), None
    except FAILURES as caught:
        return {}, caught


def _gathered_digests(digests: dict[str, str]) -> dict[str, str]:
    """Every rank's digests, merged on rank 0 ({} elsewhere)."""
    merged: dict[str, str] = {}
    for part in gather_objects_on_rank0(digests) or []:
        for name, digest in part.items():
            merged.setdefault(name, digest)
    return merged


def _hash_check_across_ranks(
    folder: Path, algorithm: str, expected: dict[str, tuple[int, str]]
) -> str | None:
    """A ``checkpoint_files.HashCheck`` for rank 0 while the others ``_serve_hash_checks``:
    each rank hashes its share (``hash_share``) at once; the first problem, by rank."""
    return _check_my_share(from_rank0((str(folder), algorithm, expected)))


def _check_my_share(request: tuple[str, str, dict[str, tuple[int, str]]]) -> str | None:
    folder, algorithm, expected = request
    sizes = {name: size for name, (size, _) in expected.items()}
    mine = hash_share(sizes, dist.get_rank(), dist.get_world_size())
    try:
        problem = check_digests_here(Path(folder), algorithm, {n: expected[n] for n in mine})
    except OSError as error:  # gone or unreadable since its size was checked
        problem = f"{folder}: {error}"
    return next((p for p in gather_objects(problem) if p is not None), None)


def _serve_hash_checks() -> None:
    """Ranks other than 0: hash this rank's share of each folder rank 0 verifies, until
    rank 0 is done (it sends None)."""
    while (request := from_rank0(None)) is not None:
        _check_my_share(request)


def rank0_with_hash_helpers(work: Callable[[HashCheck], T]) -> tuple[T | None, Exception | None]:
    """Collective: ``work(hash_check)`` on rank 0, where ``hash_check`` splits the hashing
    of every folder ``work`` verifies across all ranks (they hash in parallel, each its
    share, meanwhile). Rank 0 gets ``work``'s result or the error it raised (for the caller
    to agree on); the other ranks get ``(None, None)``."""
    if dist.get_rank() != 0:
        _serve_hash_checks()
        return None, None
    try:
        return work(_hash_check_across_ranks), None
    except FAILURES as caught:
        return None, caught
    finally:
        from_rank0(None)  # the others stop serving


def verify_across_ranks(folder: Path, parts: tuple[str, ...] | None = None) -> int:
    """Collective ``checkpoint_files.verify``: rank 0 checks the manifest and the sizes,
    every rank hashes a share, and every rank raises the same ``CheckpointError`` (or
    returns the same step)."""
    step, error = rank0_with_hash_helpers(
        lambda hash_check: verify(folder, parts=parts, hash_check=hash_check)
    )
    if error is not None and not isinstance(error, CheckpointError):
        raise error  # not a verdict on the checkpoint: the watchdog's to judge
    step, problem = from_rank0((step, None if error is None else str(error)))
    if problem is not None:
        raise CheckpointError(problem)
    return step


def _make_staging(staging: Path, *parts: str) -> BaseException | None:
    """Rank 0: an empty ``staging`` folder with ``parts`` inside; the error, if any."""
    if dist.get_rank() != 0:
        return None
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for part in parts:
            (staging / part).mkdir()
    except OSError as caught:
        return caught
    return None


def _commit(
    staging: Path, final: Path, config: RunConfig, step: int, digests: dict[str, str], lease=None
) -> Callable[[HashCheck], None]:
    """Rank 0's last part of a save (for ``rank0_with_hash_helpers``): the config, layout
    and manifest (the ranks' digests of their files, rank 0 hashing the rest), the rename,
    and for a training checkpoint (``iter_*``) ``latest`` and retention (its hashing split
    across ranks)."""

    def commit(hash_check: HashCheck) -> None:
        save_config(config, staging / CONFIG)
        layout = json.dumps(current_layout(config).checkpoint_record())
        write_text_atomically(staging / "layout.json", layout)
        write_manifest(staging, step, config.train.checkpoint.hashes, digests)
        if lease is not None:
            lease.check()  # never commit into a run another job holds now
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        if iteration_step(final) is not None:
            point_latest(final.parent, final)
            retire(final.parent, config.train.checkpoint.keep_last, final, hash_check)

    return commit


def _write_and_commit(
    staging: Path,
    final: Path,
    config: RunConfig,
    step: int,
    writes: list[Callable[[], object]],
    lease=None,
) -> None:
    """Collective: each of ``writes`` on every rank, its outcome agreed; each rank hashes
    the files it wrote; rank 0 commits (``_commit``). Any failure raises on every rank."""
    what = save_description(final)
    log = WriteLog()
    for write in writes:
        _agree(log.attempt(write), staging, what)
    digests, error = _hash_own_files(staging, log, config.train.checkpoint.hashes)
    _agree(error, staging, what)
    commit_across_ranks(staging, final, config, step, digests, lease)


def save_description(final: Path) -> str:
    """How errors name a save: ``checkpoint <folder>`` or ``weights <folder>``."""
    return f"{'checkpoint' if iteration_step(final) is not None else 'weights'} {final}"


def commit_across_ranks(
    staging: Path, final: Path, config: RunConfig, step: int, digests: dict[str, str], lease=None
) -> None:
    """Collective, once every rank's files are written and ``digests`` holds this rank's
    hashes of its own: rank 0 commits (``_commit``); any failure raises on every rank."""
    commit = _commit(staging, final, config, step, _gathered_digests(digests), lease)
    _, error = rank0_with_hash_helpers(commit)
    _agree(error, staging, save_description(final))


def _save_weights(engine: Engine, model, folder: Path) -> None:
    with engine.whole_weights():  # ZeRO-3 partitions the parameters themselves
        dist_checkpointing.save(sharded_state_dict(model), str(folder))


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
        f"{names[0]}), so the run diverged; {kept}. Lower train.optimizer.lr (or set "
        "train.optimizer.clip_grad) and resume from it"
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
    final, staging = open_staging(checkpoints, engine, model, state.step)
    trainer_file = staging / "trainer" / f"rank{dist.get_rank()}.pt"
    writes = [
        lambda: _save_weights(engine, model, staging / "model"),
        lambda: engine.save_state(staging / "engine"),
        lambda: torch.save(trainer_record(state), trainer_file),
    ]
    try:
        _write_and_commit(staging, final, config, state.step, writes, lease)
    except KeyboardInterrupt:  # a second Ctrl-C: the save is abandoned, the previous stands
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def open_staging(checkpoints: Path, engine: Engine, model, step: int) -> tuple[Path, Path]:
    """Collective, the start of every save, synchronous or not: refuse weights that are not
    finite, then an empty staging folder. Returns (the final folder, its staging folder)."""
    with engine.whole_weights():  # ZeRO-3: each rank's partition alone would be empty
        refuse_non_finite_weights(checkpoints, model, step)
    final = iteration_dir(checkpoints, step)
    staging = final.with_name(final.name + ".tmp")
    _agree(_make_staging(staging, "model", "trainer"), staging, save_description(final))
    return final, staging


def trainer_record(state: TrainerState) -> dict:
    """What ``trainer/rank<r>.pt`` holds: the trainer state and this rank's RNG states."""
    return {"state": asdict(state), "rng": _rng_state()}


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
    verify_across_ranks(folder, WEIGHT_PARTS)
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
class ResumeMode:
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


def resume_mode(folder: Path, config: RunConfig, weights_only: bool = False) -> ResumeMode:
    """Whether the optimizer state of checkpoint ``folder`` comes back in this run's
    layout (each engine says where its format reshards), or why it restarts."""
    saved, current = saved_layout(folder), current_layout(config)
    if weights_only:
        return ResumeMode(saved, current, False, "as asked (--resume weights:PATH)")
    if saved == current:
        return ResumeMode(saved, current, True)
    engine = engine_class(config.train.engine)
    try:
        why = engine.optimizer_restart_reason(saved, current, folder / "engine")
    except Exception as error:  # rank 0 decides for all: a damaged file must not stall them
        why = f"its optimizer state could not be read ({type(error).__name__}: {error})"
    if why is None:
        return ResumeMode(saved, current, True)
    change = (
        f"{saved.describe_sizes()} {saved.optimizer_sharding} -> {current.describe_sizes()} "
        f"{current.optimizer_sharding}"
    )
    return ResumeMode(saved, current, False, f"the optimizer state cannot follow {change}: {why}")


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


def load_exact(folder: Path, engine: Engine, mode: ResumeMode | None = None) -> TrainerState:
    """Collective: weights, optimizer, RNG and trainer state. In the saved layout bit for
    bit; in another (``mode`` keeps the optimizer) the engine reshards its state, and the
    RNG comes from the saved rank at the same model-parallel position where there is one
    (``_saved_rank``; otherwise this rank keeps its seeded generators)."""
    engine.load_state(folder / "engine", folder / "model")
    if mode is None or mode.exact:
        state, rng = load_trainer_state(folder, dist.get_rank())
        _set_rng_state(rng)
        return state
    state, _ = load_trainer_state(folder)  # step and data position: the same on every rank
    source = _saved_rank(mode.saved)
    if source is not None:
        _set_rng_state(load_trainer_state(folder, source)[1])
    return state


def save_weights(folder: Path, model, config: RunConfig) -> Path:
    """Collective: a weights-only checkpoint (``train.init_from`` reads it), atomic."""
    staging = folder.with_name(folder.name + ".tmp")
    _agree(_make_staging(staging, "model"), staging, f"weights {folder}")
    writes = [lambda: dist_checkpointing.save(sharded_state_dict(model), str(staging / "model"))]
    _write_and_commit(staging, folder, config, 0, writes)
    return folder
