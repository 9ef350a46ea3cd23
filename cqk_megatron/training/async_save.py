"""Asynchronous checkpoint saves (``train.checkpoint.async_save``): training goes on while the files
are written, and the checkpoint is committed only once every rank has written its own.

A save has three stages here, against one for ``checkpoint.save``:

1. **Stage** (collective, on the main thread, training waits): the staging folder is
   made as for a synchronous save; the weights go through Megatron-Core's asynchronous
   distributed-checkpoint save (``dist_checkpointing.save(..., async_sharded_save=True)``:
   its planning collectives run now and it returns an ``AsyncRequest``), whose write
   buckets are copied to host memory; the engine's ``save_state`` runs with its file
   writes captured (``torch.save`` keeps a host copy of the object instead of writing it,
   and a distributed-checkpoint save inside it becomes asynchronous too); the trainer
   state is copied. A copy, always: on CPU, ``tensor.to("cpu")`` is the live tensor
   itself, which the next optimizer step overwrites.
2. **Write** (a child process forked on each rank, training runs; ``async_writer``
   says why a process and how it is bounded): Megatron's write function for each
   request, ``torch.save`` of each captured object (the same bytes as a synchronous
   save: the copies keep the originals' storage sharing), then this rank hashes the
   files it wrote.
3. **Commit** (collective, at a step boundary once every rank's writer has ended, or
   waited for at the next save, at a stop and at the end): Megatron's finalize functions
   (rank 0 writes the distributed checkpoints' metadata), the errors of every rank agreed,
   then ``checkpoint.commit_across_ranks``: manifest, rename, ``latest``, retention.

Until then the checkpoint is an ``iter_N.tmp`` folder, which no resume takes: a job
killed mid-write resumes from the previous checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from cqk_megatron.config import RunConfig
from cqk_megatron.parallel.device import device
from cqk_megatron.run.checkpoint_files import CheckpointSaveError
from cqk_megatron.training import checkpoint, collectives
from cqk_megatron.training.async_writer import Staged, Writer
from cqk_megatron.training.checkpoint import FAILURES, TrainerState, WriteLog
from cqk_megatron.training.engines.protocol import Engine
from cqk_megatron.training.resilience import watchdog


def enabled(config: RunConfig) -> bool:
    """``train.checkpoint.async_save``; unset (null) means on on GPU and off on CPU."""
    chosen = config.train.checkpoint.async_save
    return device().type == "cuda" if chosen is None else bool(chosen)


# -- stage -----------------------------------------------------------------------------


def host_copy(value, memo: dict | None = None):
    """``value`` with every tensor in its dicts, lists and tuples copied to host memory.
    Tensors that share a storage share the copy of it (at the same offsets), and a
    tensor met twice is copied once, so ``torch.save`` of the copy writes what it would
    have written for the original (on CPU, the same bytes)."""
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        return _tensor_copy(value, memo)
    if not isinstance(value, dict | list | tuple):
        return value
    if id(value) not in memo:  # met twice, copied once: pickle writes it once too
        memo[id(value)] = _container_copy(value, memo)
    return memo[id(value)]


def _container_copy(value, memo: dict):
    if isinstance(value, dict):
        copied = {k: host_copy(v, memo) for k, v in value.items()}
        return copied if type(value) is dict else _rebuilt(value, copied.items())
    items = [host_copy(v, memo) for v in value]
    if type(value) in (list, tuple):
        return type(value)(items)
    return type(value)(*items) if hasattr(value, "_fields") else _rebuilt(value, items)


def _rebuilt(original, items):
    """A dict or list subclass (``OrderedDict``) rebuilt with ``items`` and the original's
    attributes (a ``state_dict()``'s ``_metadata``, which ``torch.save`` writes too), or
    the original when its type cannot be built that way (then left shared)."""
    try:
        rebuilt = type(original)(items)
    except TypeError:
        return original
    attributes = getattr(original, "__dict__", None)  # none on a torch.Size
    if attributes:
        rebuilt.__dict__.update(attributes)
    return rebuilt


def _tensor_copy(tensor: torch.Tensor, memo: dict) -> torch.Tensor:
    if id(tensor) in memo:
        return memo[id(tensor)]
    storage = tensor.untyped_storage()
    key = ("storage", storage.data_ptr(), storage.device)
    if key not in memo:
        memo[key] = storage.cpu() if storage.device.type != "cpu" else storage.clone()
    host = torch.empty(0, dtype=tensor.dtype, device="cpu")  # the host copy, by design
    host.set_(memo[key], tensor.storage_offset(), tensor.size(), tensor.stride())
    if isinstance(tensor, torch.nn.Parameter):
        host = torch.nn.Parameter(host, requires_grad=tensor.requires_grad)
    elif tensor.requires_grad:  # pickled with the tensor (DeepSpeed's fp32 partitions)
        host.requires_grad_(True)
    memo[id(tensor)] = host
    return host


def _stage_request(request):
    """An ``AsyncRequest`` whose write buckets are host copies (Megatron's own preload
    only moves GPU tensors: CPU ones would still be the live ones)."""
    if request.async_fn is None or request.preload_fn is None:
        return request
    args = list(request.async_fn_args)
    args[1] = [(name, key, (data, host_copy(tensors))) for name, key, (data, tensors) in args[1]]
    return request._replace(async_fn_args=tuple(args), preload_fn=None)


@contextlib.contextmanager
def staging_writes(staged: Staged):
    """During the body, on this process's main thread: ``torch.save(obj, path)`` keeps a
    host copy of ``obj`` in ``staged`` instead of writing, and ``dist_checkpointing.save``
    is asynchronous, its request kept in ``staged``. Other threads write as usual."""
    main = threading.main_thread()
    original_save, original_dcp = torch.save, dist_checkpointing.save

    def save(obj, f, *args, **kwargs):
        if threading.current_thread() is not main or not isinstance(f, str | os.PathLike):
            return original_save(obj, f, *args, **kwargs)
        staged.files.append((Path(f), host_copy(obj), {"args": args, "kwargs": kwargs}))
        return None

    def dcp_save(*args, **kwargs):
        if threading.current_thread() is not main:
            return original_dcp(*args, **kwargs)
        request = original_dcp(*args, **{**kwargs, "async_sharded_save": True})
        staged.requests.append(_stage_request(request))
        return None

    torch.save, dist_checkpointing.save = save, dcp_save
    try:
        yield staged
    finally:
        torch.save, dist_checkpointing.save = original_save, original_dcp


# -- commit ----------------------------------------------------------------------------


@dataclass
class PendingSave:
    """A staged save whose files are being written (one per run at a time)."""

    staging: Path
    final: Path
    config: RunConfig
    step: int
    lease: object
    writer: Writer
    boundaries: int = 0

    def everywhere_written(self) -> bool:
        """Collective: True on every rank once every rank's writer has finished."""
        self.boundaries += 1
        if self.boundaries >= self.writer.hold_steps:
            self.writer.release()
        return not collectives.any_rank(self.writer.is_alive())

    def wait(self) -> None:
        """This rank's writer ended, bounded by ``train.resilience.save_timeout_s`` (then
        killed)."""
        self.writer.release()
        self.writer.join(self.config.train.resilience.save_timeout_s)
        if self.writer.is_alive():
            self.writer.kill()
            self.writer.error = TimeoutError(
                f"the asynchronous write of {self.final} did not finish within "
                f"train.resilience.save_timeout_s={self.config.train.resilience.save_timeout_s} s"
            )

    def commit(self) -> None:
        """Collective, every rank's writer finished: Megatron's finalize functions, every
        rank's errors agreed, then the manifest, rename, ``latest`` and retention."""
        what = checkpoint.save_description(self.final)
        checkpoint._agree(self.writer.error, self.staging, what)
        error = None
        try:
            self.writer.finalize()
        except FAILURES as caught:
            error = caught
        checkpoint._agree(error, self.staging, what)
        checkpoint.commit_across_ranks(
            self.staging, self.final, self.config, self.step, self.writer.digests, self.lease
        )


def stage(
    checkpoints: Path, engine: Engine, model, config: RunConfig, state: TrainerState, lease=None
) -> PendingSave:
    """Collective: stage a save of ``state`` (see the module's docstring) and start this
    rank's writer process. Any failure while staging raises on every rank."""
    final, staging = checkpoint.open_staging(checkpoints, engine, model, state.step)
    what = checkpoint.save_description(final)
    staged = Staged()
    trainer = host_copy(checkpoint.trainer_record(state))
    trainer_file = staging / "trainer" / f"rank{dist.get_rank()}.pt"
    staged.files.append((trainer_file, trainer, {"args": (), "kwargs": {}}))
    parts: list[Callable[[], object]] = [
        lambda: checkpoint._save_weights(engine, model, staging / "model"),
        lambda: engine.save_state(staging / "engine"),
    ]
    log = WriteLog()
    for part in parts:
        # guarded around the capture: a rank whose capture fails inside DeepSpeed's
        # collective save must still reach its closing barrier before ``_agree``
        with staging_writes(staged):
            error = log.attempt(part)
        checkpoint._agree(error, staging, what)
    writer = Writer(staged, staging, config.train.checkpoint.hashes)
    try:
        writer.start()
        error = None
    except OSError as caught:  # no memory or no process left for the fork
        error = caught
    try:
        checkpoint._agree(error, staging, what)
    except CheckpointSaveError:
        writer.kill()  # another rank could not start its writer: this one's write is void
        raise
    return PendingSave(staging, final, config, state.step, lease, writer)


class Saver:
    """The loop's checkpoint saves: synchronous (``checkpoint.save``) or asynchronous, at
    most one in flight. Every method is collective."""

    def __init__(self, checkpoints: Path, engine: Engine, model, config: RunConfig, lease=None):
        self.checkpoints, self.engine, self.model = checkpoints, engine, model
        self.config, self.lease = config, lease
        self.asynchronous = enabled(config)
        self.pending: PendingSave | None = None

    def save(self, state: TrainerState) -> None:
        self.finish()  # the previous save is committed before the next is staged
        with watchdog.phase("save"):
            if not self.asynchronous:
                checkpoint.save(
                    self.checkpoints, self.engine, self.model, self.config, state, self.lease
                )
                return
            self.pending = stage(
                self.checkpoints, self.engine, self.model, self.config, state, self.lease
            )

    def poll(self, step: int) -> None:
        """At a step boundary: commit the save in flight if every rank has written it."""
        if self.pending is not None and self.pending.everywhere_written():
            self._commit(f"at step {step}")

    def finish(self) -> None:
        """Wait for the save in flight (bounded) and commit it: before the next save, a
        stop's exit and the end of training."""
        if self.pending is not None:
            with watchdog.phase("save"):
                self.pending.wait()
            self._commit("waited for")

    def _commit(self, when: str) -> None:
        pending, self.pending = self.pending, None
        if pending is None:
            return
        with watchdog.phase("save"):
            pending.commit()
        if dist.get_rank() == 0:
            print(f"checkpoint {pending.final} committed ({when})", file=sys.stderr, flush=True)
