"""Megatron-Core's own data-parallel engine: its DistributedDataParallel and distributed
optimizer around this rank's Megatron model (``train.engine=megatron``).

Wired the way Megatron-LM's ``training.py`` wires them (``setup_model_and_optimizer`` and
``train_step``):

- ``DistributedDataParallel`` keeps a contiguous fp32 gradient buffer (``main_grad``) that
  accumulates every micro-batch; ``finalize_model_grads`` (called by the schedule after
  the last backward) reduce-scatters it over the data-parallel group and all-reduces the
  tied embedding between the first and last pipeline stages. ``no_sync`` is handed to
  the schedule only when the reduction overlaps the backward, as Megatron-LM does.
- ``get_megatron_optimizer`` builds the distributed optimizer: AdamW whose fp32 master
  weights and moments are sharded over the data-parallel ranks; after the step each rank
  all-gathers the updated parameters. Transformer Engine's or Apex's fused Adam is used
  when installed, ``torch.optim.AdamW`` otherwise (Megatron's own fallback).
- Every step, PP=1 included, runs through ``get_forward_backward_func()``.
- A constant loss scale of 1 turns on Megatron's non-finite gradient check (multiplying
  by 1 changes no bit): a step with a NaN/inf gradient anywhere is skipped on every rank.

Resume saves the optimizer's ``sharded_state_dict`` with ``dist_checkpointing`` in the
format ``train.optimizer_checkpoint`` names (Megatron's sharding types):

- ``dp_reshardable`` (the default): each rank writes its own shard of each gradient
  bucket, no gathering. It loads under another data-parallel size (each rank takes its
  slice of every bucket), as long as the buckets are the same: one per buffer without
  ``overlap_grad_reduce``, a size derived from the model with it (``bucket_elements``).
  Saved under other buckets, it is refused at load (``check_same_buckets``).
- ``fully_reshardable``: each parameter's fp32 master weight and Adam moments under the
  parameter's own sharded key, so the state loads under another tensor-, pipeline- or
  data-parallel size. Saving gathers the data-parallel shards on data-parallel rank 0 of
  each model-parallel group over gloo (``distrib_optim_fully_reshardable_mem_efficient``:
  host memory, the same path on CPU and GPU; the default all-gathers through
  ``torch.cuda``), which then writes them all: several times slower than the default.

A load reads the format the checkpoint was saved in; the weights come from the
checkpoint's model folder.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate
from megatron.core.optimizer_param_scheduler import ParamGroupOverride

from cqk_megatron.config import RunConfig
from cqk_megatron.model.attention.tp_grads import (
    sum_accumulated_grads_across_tp,
    take_over_tp_sums,
)
from cqk_megatron.model.gpt import load_sharded_state, model_chunks, sharded_state_dict
from cqk_megatron.parallel.layout import Layout
from cqk_megatron.perf import traffic
from cqk_megatron.run.checkpoint_files import CheckpointError
from cqk_megatron.training.collectives import gather_objects
from cqk_megatron.training.engines.protocol import Batch, Engine, StepResult, sharding_change
from cqk_megatron.training.step_loss import global_mean_loss, schedule_loss_sum

FULLY_RESHARDABLE = "fully_reshardable"


def bucket_elements(chunk: torch.nn.Module) -> int:
    """The gradient bucket of a model chunk with ``overlap_grad_reduce``: the bucket rule
    of ``perf.traffic`` (Megatron's 40M elements, smaller where the chunk holds fewer than
    ``BUCKETS_PER_BACKWARD`` such buckets), taken at DP=1. Megatron's own rule grows with
    DP beyond 40 ranks (1M x DP): that would change the buckets, and dp_reshardable
    checkpoints would no longer load under another data-parallel size there."""
    return traffic.reduce_bucket_elements(sum(p.numel() for p in chunk.parameters()), 1)


def _sharding(optimizer_format: str) -> dict:
    """``DistributedOptimizer.sharded_state_dict``'s metadata for ``optimizer_format``."""
    return {
        "distrib_optim_sharding_type": optimizer_format,
        "distrib_optim_fully_reshardable_mem_efficient": True,
    }


def saved_optimizer_format(folder: Path) -> str:
    """The format the optimizer in ``folder`` (a checkpoint's ``engine/``) was saved in:
    ``DistributedOptimizer`` records it in the checkpoint's common (rank 0) state."""
    common = dist_checkpointing.load_common_state_dict(str(folder))
    return common["optimizer"]["param_state_sharding_type"]


def optimizer_config(config: RunConfig) -> OptimizerConfig:
    t = config.train
    return OptimizerConfig(
        optimizer="adam",
        decoupled_weight_decay=True,  # AdamW
        lr=t.optimizer.lr,
        min_lr=t.schedule.min_lr,
        weight_decay=t.optimizer.weight_decay,
        adam_beta1=t.optimizer.beta1,
        adam_beta2=t.optimizer.beta2,
        adam_eps=t.optimizer.eps,
        clip_grad=t.optimizer.clip_grad,
        bf16=t.precision == "bf16",
        params_dtype=torch.bfloat16 if t.precision == "bf16" else torch.float32,
        use_distributed_optimizer=True,
        # A unit scale: exact, and it makes the optimizer check gradients for NaN/inf and
        # skip the step (bf16 without a scaler would step on them).
        loss_scale=1.0,
    )


def no_weight_decay_overrides() -> dict[ParamKey, ParamGroupOverride]:
    """The same rule as the DeepSpeed engine's ``param_groups``: no decay on vectors and
    scalars (norms, dt, lambda). Megatron's default (1-D and ``*.bias``) would decay 0-D."""
    vectors_and_scalars = ParamPredicate(name="dim_below_2", fn=lambda param: param.dim() < 2)
    return {ParamKey(predicate=vectors_and_scalars): ParamGroupOverride(wd_mult=0.0)}


class MegatronEngine(Engine):
    @classmethod
    def optimizer_restart_reason(cls, saved: Layout, current: Layout, folder: Path) -> str | None:
        """Why the optimizer state in ``folder`` (saved under ``saved``) cannot be loaded
        under ``current``, or None when it can (the same engine, and a format that reshards
        there)."""
        if changed := sharding_change(saved, current):
            return changed
        if (saved.tp, saved.pp) == (current.tp, current.pp):
            return None  # both formats reshard over data-parallel ranks
        found = saved_optimizer_format(folder)
        if found != FULLY_RESHARDABLE:
            return (
                f"it was saved in Megatron's {found} format, which reshards over data-parallel "
                f"ranks only (train.optimizer_checkpoint={FULLY_RESHARDABLE} saves checkpoints "
                "that follow TP and PP changes too)"
            )
        return None

    def __init__(self, model: torch.nn.Module, config: RunConfig) -> None:
        self.config = config
        self.model = model
        t = config.train
        overlap = t.overlap_grad_reduce
        chunks = model_chunks(model)
        # Before DDP wraps the chunks: their TP partial gradients are summed once a step
        # in fp32 (``finalize``), not by a bf16 all-reduce per parameter per micro-batch.
        self.tp_partial = [p for chunk in chunks for p in take_over_tp_sums(chunk, ())]
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=overlap,
            bucket_size=bucket_elements(chunks[0]),  # used with overlap only
            use_distributed_optimizer=True,
            check_for_nan_in_grad=False,  # it raises; the optimizer's check skips instead
        )
        # One DDP per virtual-pipeline chunk; only the first is bucketed (Megatron-LM's
        # choice: later chunks' gradients are ready at once, at the end of the step).
        self.chunks = [
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=ddp_config,
                module=chunk,
                disable_bucketing=index > 0,
            )
            for index, chunk in enumerate(chunks)
        ]
        for chunk in self.chunks:  # every replica starts from data-parallel rank 0's weights
            chunk.broadcast_params()
        self.optimizer = get_megatron_optimizer(
            optimizer_config(config), self.chunks, config_overrides=no_weight_decay_overrides()
        )
        # The chunks share one TransformerConfig, which the schedule reads these from.
        model_config = self.chunks[0].config
        model_config.grad_scale_func = self.optimizer.scale_loss
        model_config.finalize_model_grads_func = self.finalize
        no_sync = [chunk.no_sync for chunk in self.chunks]
        model_config.no_sync_func = (
            (no_sync[0] if len(no_sync) == 1 else no_sync) if overlap else None
        )
        self.set_lr(t.optimizer.lr)

    # -- training ----------------------------------------------------------------------

    def finalize(self, *args, **kwargs) -> None:
        """Megatron's ``finalize_model_grads`` (the data-parallel reduce-scatter, the
        tied-embedding and sequence-parallel sums), then the TP partial gradients of the
        parameters whole on every TP rank (``attention/tp_grads.py``) summed across the
        TP group in one fp32 all-reduce of their ``main_grad``. After the data-parallel
        reduction: both are linear and commute, and TP peers hold the same data-parallel
        shard of the buffer (their parameters have the same shapes), so the shard each
        optimizer steps on is summed whole."""
        finalize_model_grads(*args, **kwargs)
        sum_accumulated_grads_across_tp(
            [param.main_grad for param in self.tp_partial],
            ps.get_tensor_model_parallel_group(),
        )

    def set_lr(self, lr: float) -> None:
        """The learning rate, and the weight decay each group's ``wd_mult`` allows
        (Megatron's ``OptimizerParamScheduler`` does the same; the loop owns the schedule)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = self.config.train.optimizer.weight_decay * group.get(
                "wd_mult", 1.0
            )

    def train_step(self, micro_batches: list[Batch]) -> StepResult:
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_sum = schedule_loss_sum(self.chunks, micro_batches, self.config, forward_only=False)
        updated, grad_norm, _ = self.optimizer.step()
        if updated and self.config.train.optimizer.clip_grad == 0:
            grad_norm = self.optimizer.get_grad_norm()  # the step only measures it to clip
        return StepResult(
            loss=global_mean_loss(loss_sum, len(micro_batches)),
            grad_norm=float(grad_norm) if updated else math.nan,
            skipped=not updated,
        )

    # -- evaluation --------------------------------------------------------------------

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[Batch]) -> float:
        for chunk in self.chunks:
            chunk.eval()
        loss_sum = schedule_loss_sum(self.chunks, micro_batches, self.config, forward_only=True)
        return global_mean_loss(loss_sum, len(micro_batches))

    # -- exact resume ------------------------------------------------------------------

    def save_state(self, folder: Path) -> None:
        """Collective: the optimizer (fp32 master weights, moments, step counts, param
        groups) as a distributed checkpoint in ``folder``, each rank writing its shard."""
        folder.mkdir(parents=True, exist_ok=True)
        state = self.optimizer.sharded_state_dict(
            sharded_state_dict(self.model),
            is_loading=False,
            metadata=_sharding(self.config.train.optimizer_checkpoint),
        )
        dist_checkpointing.save({"optimizer": state}, str(folder))

    @torch.no_grad()  # with fp32 weights the master shards are views of the parameters
    def load_state(self, folder: Path, model_folder: Path) -> None:
        """Collective: weights from ``model_folder``, then the optimizer from ``folder``
        (its fp32 master weights replace those made from the loaded weights), resharded to
        this layout where ``optimizer_restart_reason`` allows it."""
        weights = dist_checkpointing.load(sharded_state_dict(self.model), str(model_folder))
        load_sharded_state(self.model, weights)
        torch_adams = _torch_adams(self.optimizer)
        for adam in torch_adams:
            _allocate_adam_state(adam)
        sharded = self.optimizer.sharded_state_dict(
            sharded_state_dict(self.model),
            is_loading=True,
            metadata=_sharding(saved_optimizer_format(folder)),
        )
        check_same_buckets(sharded, folder)
        loaded = dist_checkpointing.load({"optimizer": sharded}, str(folder))
        for part, state in _distributed_parts(self.optimizer, loaded["optimizer"]):
            param_state = state.pop("param_state")
            found = state.pop("param_state_sharding_type")
            part.load_state_dict(state)  # the param groups and step count
            for adam in torch_adams:
                _drop_step_counts(adam)
            if found == FULLY_RESHARDABLE:
                part.load_parameter_state_from_fully_reshardable(param_state)
            else:
                part.load_parameter_state_from_dp_reshardable(param_state)
        for adam in torch_adams:
            _restore_step_counts(adam)


# A dp_reshardable key names one gradient bucket's state, ``...bucket_idx_N.param``.
_BUCKET_KEY = re.compile(r"\.bucket_idx_\d+\.param$")


def bucket_shapes(tensors) -> dict[str, tuple[int, ...]]:
    """The global shape of each gradient bucket among ``tensors`` (``ShardedTensor``s):
    empty for the fully reshardable format, whose keys are the parameters'."""
    return {
        t.key: tuple(t.global_shape)
        for t in tensors
        if isinstance(t, ShardedTensor) and _BUCKET_KEY.search(t.key)
    }


def check_same_buckets(sharded: dict, folder: Path) -> None:
    """Collective: refuse optimizer state saved in the dp_reshardable format under other
    gradient buckets than this run's: its tensors are whole buckets, which do not map onto
    other ones. The buckets change with the bucket rule (``bucket_elements``), not with the
    data-parallel size. The checkpoint holds the buckets of every model-parallel rank (its
    keys name their data-parallel group), so every rank's are gathered and all ranks
    compare the same sets and refuse together. Nothing is read but the metadata."""
    expected: dict[str, tuple[int, ...]] = {}
    for shapes in gather_objects(bucket_shapes(nested_values(sharded))):
        expected |= shapes
    if not expected:  # the fully reshardable format
        return
    saved = bucket_shapes(dist_checkpointing.load_tensors_metadata(str(folder)).values())
    if saved == expected:
        return
    checkpoint = folder.parent
    raise CheckpointError(
        f"checkpoint {checkpoint} holds its optimizer state in Megatron's dp_reshardable "
        f"format in {_describe_buckets(saved)}, and this run's buckets are "
        f"{_describe_buckets(expected)} (train.overlap_grad_reduce sizes them from the "
        f"model): resume its weights with a fresh optimizer (--resume weights:{checkpoint}); "
        f"train.optimizer_checkpoint={FULLY_RESHARDABLE} saves checkpoints that load "
        "whatever the buckets"
    )


def _describe_buckets(shapes: dict[str, tuple[int, ...]]) -> str:
    sizes = sorted({math.prod(shape) for shape in shapes.values()}, reverse=True)
    return f"{len(shapes)} gradient bucket(s) of {', '.join(f'{n:,}' for n in sizes)} elements"


# Megatron's distributed optimizer over torch's AdamW (its fallback without Transformer
# Engine or Apex) needs three repairs to load a checkpoint into a fresh optimizer:


def _torch_adams(optimizer) -> list[torch.optim.AdamW]:
    """The torch AdamW instances inside Megatron's (possibly chained) optimizer."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [p.optimizer for p in parts if isinstance(p.optimizer, torch.optim.AdamW)]


def _allocate_adam_state(adam: torch.optim.AdamW) -> None:
    """AdamW makes its state at its first step, but ``DistributedOptimizer.state_dict()``
    (which ``sharded_state_dict`` calls) asserts that the states hold exactly one step
    count, and a fresh optimizer's hold none. Zero state, as AdamW would make it; the
    checkpoint's moments replace it (and ``_restore_step_counts`` the step)."""
    for group in adam.param_groups:
        for param in group["params"]:
            if not adam.state[param]:
                adam.state[param] = {
                    # torch's AdamW (neither fused nor capturable) keeps its step on the host
                    "step": torch.zeros((), dtype=torch.float32, device="cpu"),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }


def _distributed_parts(optimizer, state_dict) -> list[tuple]:
    """Each ``DistributedOptimizer`` inside Megatron's (possibly chained) optimizer, with
    its part of a loaded ``state_dict`` (``ChainedOptimizer``'s layout: the state itself
    for one part, ``{index: state}`` for several)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(parts) == 1:
        return [(parts[0], state_dict)]
    return list(zip(parts, (state for _, state in sorted(state_dict.items())), strict=True))


def _drop_step_counts(adam: torch.optim.AdamW) -> None:
    """Before the parameter state is copied in: ``DistributedOptimizer`` copies every key
    of a parameter's optimizer state from the checkpoint, and its fully reshardable format
    has no per-parameter step (Apex's and TE's Adam keep none); ``_restore_step_counts``
    makes them again from the param groups."""
    for state in adam.state.values():
        state.pop("step", None)


def _restore_step_counts(adam: torch.optim.AdamW) -> None:
    """After the load, every state's step is one shared tensor holding the placeholder's 0:
    ``load_state_dict`` gives all states the same tensor, then copies the (unsaved) step of
    the placeholder state into it. AdamW adds 1 to each state's step in place, so a shared
    one would also count once per parameter. The count the checkpoint holds is in the
    param groups (``DistributedOptimizer.state_dict`` puts it there): one tensor per state."""
    for group in adam.param_groups:
        for param in group["params"]:
            adam.state[param]["step"] = torch.tensor(
                float(group["step"]), dtype=torch.float32, device="cpu"
            )
