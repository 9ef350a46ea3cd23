"""The DeepSpeed ZeRO engine around this rank's Megatron-Core model.

Tensor and pipeline parallelism are Megatron's (its layers, ``parallel_state`` and
schedules); data-parallel sharding of optimizer state and gradients is DeepSpeed ZeRO,
given Megatron's groups through ``MegatronMpu``. Two ways to drive a step:

- PP=1: DeepSpeed owns gradient accumulation: ``engine.backward`` then ``engine.step``
  per micro-batch (ZeRO-2/3 reduce inside each backward, so this is the only way).
- PP>1: Megatron's 1F1B schedule (interleaved over the model chunks of
  ``parallel.virtual_pipeline``) runs every micro-batch of the global batch (it calls
  backward itself), then ``engine.allreduce_gradients()`` and ``engine.step()`` with
  DeepSpeed's accumulation set to 1. Only ZeRO-1 allows that (``validate`` says so).

DeepSpeed detects a non-finite gradient norm and skips the update; the engine reports
it so the loop can count skipped steps.

In bf16 the gradients are summed in fp32, over micro-batches and across data-parallel
ranks, as the Megatron engine does (``grad_reduce_in_fp32``): see ``bf16_settings``.

Megatron's ``finalize_model_grads``, which the Megatron engine hands to its schedule, is
never called here; the two sums it does beyond data parallelism are done by
``MegatronGradSums`` (below) instead.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from argparse import Namespace
from contextlib import AbstractContextManager
from enum import Enum
from itertools import zip_longest
from pathlib import Path

import torch
from megatron.core import parallel_state as ps

from cqk_megatron.compat import cpu_bridge
from cqk_megatron.config import RunConfig
from cqk_megatron.model.attention.tp_grads import (
    left_to_finalize_model_grads,
    sum_accumulated_grads_across_tp,
    sum_grads_across_tp,
    take_over_tp_sums,
)
from cqk_megatron.model.gpt import model_chunks
from cqk_megatron.parallel.device import device
from cqk_megatron.parallel.layout import Layout
from cqk_megatron.perf import traffic
from cqk_megatron.training import collectives
from cqk_megatron.training.collectives import gather_objects
from cqk_megatron.training.collector import heavy_imports
from cqk_megatron.training.engines.protocol import Batch, Engine, StepResult, sharding_change
from cqk_megatron.training.mpu import MegatronMpu
from cqk_megatron.training.step_loss import (
    forward,
    global_mean_loss,
    lm_loss,
    schedule_loss_sum,
)


def deepspeed_config(
    config: RunConfig, gradient_accumulation_steps: int, bucket_elements: int | None = None
) -> dict:
    """DeepSpeed's config for ``config``; ``bucket_elements``: the gradient-reduction and
    parameter-gather buckets (``perf.traffic.reduce_bucket_elements`` of this rank's
    parameters; None leaves DeepSpeed's 5e8, one bucket for any model this trains)."""
    t = config.train
    ds: dict = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "gradient_clipping": t.optimizer.clip_grad,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": t.precision == "bf16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if t.precision == "bf16":
        ds.update(bf16_settings())
    if t.zero_stage == 3:
        # DeepSpeed's default swaps torch.nn.functional.linear for its own autograd Function
        # in the whole process, for good ("This will persist unless manually reset"). No
        # Megatron layer calls F.linear; the coupling's fused form does, and under it loses
        # forward-mode AD and meets a Function inductor must trace. What DeepSpeed's version
        # saves (a weight gathered for the forward, not kept for the backward) is nothing
        # here: f's weights (head_dim x coupling_hidden, 33k elements at 1B) are under
        # stage3_param_persistence_threshold (1e5), so ZeRO-3 keeps them whole anyway.
        ds["zero_optimization"]["memory_efficient_linear"] = False
    if t.overlap_grad_reduce:  # reduce in buckets during the backward (PP=1: validate)
        ds["zero_optimization"]["overlap_comm"] = True
    if bucket_elements is not None:
        # Each bucket is reduced as soon as it is full: with several a backward, all but
        # the last go while autograd still computes (docs/engines.md, "Communication").
        ds["zero_optimization"]["reduce_bucket_size"] = bucket_elements
        ds["zero_optimization"]["allgather_bucket_size"] = bucket_elements
    if t.offload_optimizer:
        on_gpu = device().type == "cuda"
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    # make_optimizer chooses the optimizer (torch's AdamW steps offloaded master weights
    # where DeepSpeed's CPU Adam is not built), so DeepSpeed must not insist on its own.
    ds["zero_force_ds_cpu_optimizer"] = False
    return ds


def bf16_settings() -> dict:
    """bf16 parameters with fp32 gradient sums, as the Megatron engine has them.

    Left to its defaults DeepSpeed accumulates the micro-batches' gradients in bf16 (in
    ``param.grad``) and all-reduces them in bf16: 8 micro-batches x 16 data-parallel ranks
    summed with 8 mantissa bits. With ``grad_accum_dtype`` fp32 DeepSpeed 0.19.8 picks
    ``BF16_Optimizer`` for ZeRO-1 (an fp32 gradient buffer beside the fp32 master weights)
    and its ZeRO-2/3 optimizers accumulate into fp32 gradient partitions;
    ``communication_data_type`` fp32 makes every stage reduce in fp32.

    ``immediate_grad_update``: ``BF16_Optimizer`` adds each bf16 gradient into its fp32
    buffer from a hook as soon as autograd has it, instead of in ``engine.backward``'s
    epilogue. Megatron's pipeline schedule (PP>1) calls plain backward, so without the
    hook the fp32 buffer stays empty ("stack expects a non-empty TensorList" at the step);
    with it every micro-batch's gradient is summed in fp32 under both ways of driving a
    step (PP=1 gives the same numbers either way).
    """
    return {
        "bf16": {"enabled": True, "immediate_grad_update": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32",
    }


def device_args() -> Namespace:
    """What ``deepspeed.initialize`` reads as ``args``: only ``device_rank``, this rank's
    device index. Without it DeepSpeed binds ``cuda:LOCAL_RANK``, which does not exist
    where each task sees one GPU (``CUDA_VISIBLE_DEVICES``, srun); ``device()`` takes
    the local rank modulo the visible GPUs. On CPU DeepSpeed's CPU accelerator ignores it.
    """
    here = device()
    return Namespace(device_rank=0 if here.index is None else here.index)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on vectors and scalars (norms, biases, dt, lambda)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model: torch.nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    """AdamW for DeepSpeed to wrap, chosen to need no compiler on the node.

    - GPU: torch's fused AdamW (``fused=True``), a CUDA kernel inside the torch wheel.
      DeepSpeed's ``FusedAdam`` is not prebuilt in DeepSpeed's wheels: it is JIT-compiled
      with ``nvcc`` at the first start, which a node with only pip wheels lacks (or has
      for another CUDA than torch's), and a rank killed during that build leaves a lock
      file that stalls every later start. Both compute the same AdamW update.
    - GPU with ``train.offload_optimizer``: DeepSpeed's ``DeepSpeedCPUAdam`` (SIMD, several
      times faster on the host) if this DeepSpeed was installed with it prebuilt
      (``DS_BUILD_CPU_ADAM=1``); otherwise torch's AdamW steps the offloaded fp32 master
      weights on the host (the CPU path of the tests), with a warning saying so.
    - CPU: torch's AdamW.
    """
    t = config.train
    kwargs = {
        "lr": t.optimizer.lr,
        "betas": (t.optimizer.beta1, t.optimizer.beta2),
        "eps": t.optimizer.eps,
    }
    groups = param_groups(model, t.optimizer.weight_decay)
    on_gpu = device().type == "cuda"
    if t.offload_optimizer and on_gpu:
        if _prebuilt_deepspeed_op("cpu_adam"):
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
        print(
            "warning: train.offload_optimizer=true: this DeepSpeed has no prebuilt CPU Adam, "
            "so torch's AdamW steps the offloaded weights on the host (slower); reinstall "
            "DeepSpeed with DS_BUILD_CPU_ADAM=1 for its SIMD CPU Adam",
            file=sys.stderr,
            flush=True,
        )
        return torch.optim.AdamW(groups, **kwargs)
    if on_gpu:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def _prebuilt_deepspeed_op(name: str) -> bool:
    """Whether DeepSpeed was installed with op ``name`` compiled (no JIT build needed)."""
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        return False
    return bool(installed_ops.get(name, False))


class TpGradSum(Enum):
    """When DeepSpeed's engine sums the TP partial gradients (``when_to_sum_tp_grads``)."""

    HOOKS = "per-parameter hooks in every backward"
    BEFORE_DP_REDUCTION = "one all-reduce a step, before DeepSpeed's data-parallel reduction"
    AFTER_DP_REDUCTION = "one all-reduce a step, of this rank's ZeRO partition after it"


def when_to_sum_tp_grads(config: RunConfig) -> TpGradSum:
    """When the TP partial gradients of ``MegatronGradSums`` can be summed, given where
    DeepSpeed 0.19.8 reduces over data parallelism (``engine.allreduce_gradients``,
    ``zero/stage_1_and_2.py``). The TP sum and the data-parallel average are both linear
    over the micro-batches and commute, so one all-reduce a step does, placed:

    - ``BEFORE_DP_REDUCTION``, ZeRO-1: DeepSpeed reduces at the accumulation boundary only
      (``reduce_gradients``; in bf16 ``BF16_Optimizer`` reduces its fp32 buffer there,
      ``immediate_grad_update`` only adding each micro-batch into it), so the sum runs on
      the accumulated gradients, then ``allreduce_gradients``.
    - ``AFTER_DP_REDUCTION``, ZeRO-2, and ZeRO-1 with ``overlap_comm`` (fp32 only, PP=1
      only: ``validate``): DeepSpeed takes each gradient from its hooks inside the backward
      (every one at ZeRO-2, the last at ZeRO-1), so the sum runs after the last
      micro-batch's backward, on this rank's partition of the reduced gradients
      (``zero_partition_grads``), before ``engine.step`` computes the norm and steps.
    - ``HOOKS`` elsewhere: each backward's hooks sum before DeepSpeed takes the gradient.
      ZeRO-3 keeps its gradient partitions in other structures (``stage3.py``, one slice
      of each parameter per rank) that this bridge does not read; with
      ``offload_optimizer`` each reduced slice is copied to the host and its norm taken
      inside the backward (``norm_for_param_grads``), before the step's end.
    ``DeepSpeedEngine`` checks DeepSpeed's state after ``deepspeed.initialize``
    (``check_when_to_sum_tp_grads``).
    """
    t = config.train
    if t.zero_stage == 3 or t.offload_optimizer:
        return TpGradSum.HOOKS
    if t.zero_stage == 2 or t.overlap_grad_reduce:
        return TpGradSum.AFTER_DP_REDUCTION
    return TpGradSum.BEFORE_DP_REDUCTION


def check_when_to_sum_tp_grads(engine, when: TpGradSum) -> None:
    """Refuse to go on if DeepSpeed's engine keeps the gradients elsewhere than
    ``when_to_sum_tp_grads`` expects (a DeepSpeed change): the TP sums would miss them, and
    the replicas would drift. Nothing to check for the hooks."""
    optimizer = engine.optimizer
    if when is TpGradSum.BEFORE_DP_REDUCTION:
        found = {
            "partitioned gradients (ZeRO-2/3)": engine.zero_optimization_partition_gradients(),
            "overlap_comm": getattr(optimizer, "overlap_comm", False),
            "grad_accum attributes": getattr(optimizer, "use_grad_accum_attribute", False),
        }
    elif when is TpGradSum.AFTER_DP_REDUCTION:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        found = {
            "no ZeRO-1/2 partition": not isinstance(optimizer, DeepSpeedZeroOptimizer),
            "cpu_offload": getattr(optimizer, "cpu_offload", False),
        }
    else:
        return
    if any(found.values()):
        raise RuntimeError(
            f"DeepSpeed's {type(optimizer).__name__} runs with "
            f"{', '.join(what for what, on in found.items() if on)}, yet "
            f"engines.deepspeed.when_to_sum_tp_grads chose to sum the TP partial gradients in "
            f"{when.value}, where DeepSpeed does not keep them; update that rule"
        )


def zero_partition_grads(
    optimizer, params: list[torch.nn.Parameter]
) -> list[tuple[torch.nn.Parameter, int, torch.Tensor]]:
    """The slices of ``params`` in this data-parallel rank's ZeRO-1/2 partition, with their
    gradients reduced over data parallelism and summed over the step's micro-batches, as
    ``step`` will clip and apply them: (parameter, its element where the slice starts, the
    slice's gradient, which may be modified in place), in partition order. Valid from the
    accumulation boundary's backward to ``step``.

    The only read of ZeRO's internals here, DeepSpeed 0.19.8 ``runtime/zero/
    stage_1_and_2.py`` (``DeepSpeedZeroOptimizer``): ``params_in_partition[group]`` and
    ``first_offset[group]`` (``__init__``, l. 587-593: the parameters with elements in this
    partition, the first from element ``first_offset``); ``averaged_gradients[group]``,
    filled at the boundary by ``independent_gradient_partition_epilogue`` (l. 1033-1056)
    and read by ``step`` for the norm (l. 2951), the overflow check (l. 3232) and the
    update (l. 3105-3117). Its entries other than padding (``_zero_padding``) are the
    slices of ``params_in_partition``, in order (as ``get_grad_norm_direct`` pairs them,
    l. 2677-2678): views of one fp32 partition buffer when gradients accumulate in fp32
    under bf16 (``_build_compact_grad_partition_buffer``, l. 1268-1300), else the
    accumulated gradients or views of them (``get_flat_partition``, l. 2712-2900).
    """
    wanted = {id(param) for param in params}
    slices = []
    for group, in_partition in enumerate(optimizer.params_in_partition):
        entries = optimizer.averaged_gradients.get(group)
        if entries is None:
            raise RuntimeError(
                f"DeepSpeed's ZeRO partition of parameter group {group} holds no gradients "
                "after the last micro-batch's backward; update "
                "engines.deepspeed.zero_partition_grads for this DeepSpeed"
            )
        grads = [g for g in entries if not getattr(g, "_zero_padding", False)]
        # get_flat_partition leaves its trailing padding (or an empty partition's zeros)
        # unmarked: always after the slices
        if len(grads) < len(in_partition):
            raise RuntimeError(
                f"DeepSpeed's ZeRO partition of parameter group {group} holds "
                f"{len(grads)} gradient slices for {len(in_partition)} parameters; update "
                "engines.deepspeed.zero_partition_grads for this DeepSpeed"
            )
        pairs = zip(in_partition, grads[: len(in_partition)], strict=True)
        for index, (param, grad) in enumerate(pairs):
            if id(param) in wanted:
                start = optimizer.first_offset[group] if index == 0 else 0
                slices.append((param, start, grad))
    return slices


def check_same_slices(layouts: list[list[tuple]]) -> None:
    """Refuse TP peers (``layouts`` in TP rank order) whose ZeRO partitions hold different
    slices of the TP partial parameters: their all-reduce would add unrelated elements."""
    for rank, layout in enumerate(layouts[1:], start=1):
        pairs = zip_longest(layouts[0], layout, fillvalue="nothing")
        for index, (first, other) in enumerate(pairs):
            if first != other:
                raise RuntimeError(
                    "the tensor-parallel ranks' ZeRO partitions hold different slices of the "
                    "TP partial parameters (data-parallel rank, name, first element, "
                    f"elements): slice {index} is {first} on TP rank 0 and {other} on TP "
                    f"rank {rank}, so their gradients cannot be summed on the partition; "
                    "set train.zero_stage=1, or report this layout"
                )


class MegatronGradSums:
    """What Megatron's ``finalize_model_grads`` adds to the data-parallel reduction, for
    DeepSpeed's engine (the Megatron engine must not have it: its ``finalize_model_grads``
    would add the same sums a second time).

    - Sequence parallelism: the TP partial gradients of the parameters Megatron marks
      ``sequence_parallel`` (the row-parallel biases) must be summed across the TP group.
      Without it each TP rank steps its copy with its own half of the gradient and the
      copies drift apart. Where one all-reduce a step can do (``when_to_sum_tp_grads``),
      ``sum_tp_partial_grads`` sums them, and with them every parameter that the model's
      own hooks would sum (``f``, ``dt``, ``lambda``, our norms under SP: the hooks are
      taken over), instead of one all-reduce per parameter per micro-batch: on the
      accumulated gradients before DeepSpeed's data-parallel reduction (ZeRO-1), or on this
      rank's partition after it (ZeRO-2). Elsewhere they get the tensor hook of
      ``attention/tp_grads.py`` that serves the others, which runs in each backward before
      DeepSpeed sees the gradient.
    - Tied embeddings under pipeline parallelism: the first stage's word embedding and the
      last stage's output layer are two copies of one weight (Megatron's build makes them
      equal). After the schedule's last backward their gradients are summed over
      Megatron's embedding group, before DeepSpeed reduces them over data parallelism; and
      the last stage's copy, which Megatron marks ``shared`` (its own gradient norm skips
      it), is marked ``ds_pipe_replicated``, the attribute by which DeepSpeed's norms
      (ZeRO's ``get_grad_norm_direct``, ``BF16_Optimizer``) skip a pipeline replica, so
      that the clipping norm counts the weight once.
    """

    def __init__(self, model: torch.nn.Module, config: RunConfig) -> None:
        self.tp_group = ps.get_tensor_model_parallel_group()
        sequence_parallel = left_to_finalize_model_grads(model, config.parallel.sequence_parallel)
        self.when = when_to_sum_tp_grads(config)
        self.tp_partial: list[tuple[str, torch.nn.Parameter]] = []
        if self.when is TpGradSum.HOOKS:
            sum_grads_across_tp(sequence_parallel, self.tp_group)
        else:
            taken = {id(p) for p in take_over_tp_sums(model, also=sequence_parallel)}
            self.tp_partial = [(n, p) for n, p in model.named_parameters() if id(p) in taken]
        # (data-parallel rank, name, first element, elements) of each slice on the partition
        self.partition_layout: list[tuple[int, str, int, int]] | None = None
        self.tied_copy = tied_embedding_copy(model)
        for param in model.parameters():
            if getattr(param, "shared", False):
                param.ds_pipe_replicated = True

    def before_data_parallel_reduction(self) -> None:
        """Collective: the step's sums beyond data parallelism, on the gradients summed over
        the step's micro-batches, before DeepSpeed reduces them over data parallelism."""
        if self.when is TpGradSum.BEFORE_DP_REDUCTION:
            self.sum_tp_partial_grads()
        self.sum_tied_embedding_grads()

    def sum_tp_partial_grads(self) -> None:
        """Collective over the TP group: one all-reduce of the accumulated gradients of every
        parameter taken over from the hooks."""
        grads = []
        for name, param in self.tp_partial:
            grad = accumulated_grad(param)
            if grad is None:  # every TP rank must bring the same buffers to the all-reduce
                raise RuntimeError(
                    f"{name} has no gradient at the step's end, so its TP partial gradients "
                    "cannot be summed; every parameter must take part in the loss"
                )
            grads.append(grad)
        sum_accumulated_grads_across_tp(grads, self.tp_group)

    def after_data_parallel_reduction(self, optimizer) -> None:
        """Collective over the TP group, after the last micro-batch's backward and before
        ``engine.step``: one all-reduce of the slices of the TP partial gradients in this
        rank's ZeRO partition, already averaged over data parallelism. The peers of one TP
        group have the same data-parallel rank, hence the same partition layout (each
        parameter has one shape on every TP rank): checked at the first step."""
        slices = zero_partition_grads(optimizer, [param for _, param in self.tp_partial])
        if self.partition_layout is None:
            names = {id(param): name for name, param in self.tp_partial}
            dp_rank = ps.get_data_parallel_rank()
            layout = [(dp_rank, names[id(p)], start, g.numel()) for p, start, g in slices]
            check_same_slices(gather_objects(layout, group=self.tp_group))
            self.partition_layout = layout
        sum_accumulated_grads_across_tp([grad for _, _, grad in slices], self.tp_group)

    def sum_tied_embedding_grads(self) -> None:
        """Collective over the embedding group (first and last stage), on the ranks that
        hold a copy; DeepSpeed has not reduced the gradients yet (validate() refuses
        ``overlap_comm`` and optimizer offload, which reduce in hooks, with a tied PP>1)."""
        if self.tied_copy is None:
            return
        grad = accumulated_grad(self.tied_copy)
        if grad is None:
            raise RuntimeError(
                "the tied embedding has no gradient after the pipeline schedule: DeepSpeed "
                "reduced it during backward (zero_optimization.overlap_comm or offload_optimizer); "
                "both must stay off with model.tie_embeddings=true and "
                "parallel.pipeline_parallel > 1"
            )
        collectives.all_reduce(grad, group=ps.get_embedding_group())


def accumulated_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """Where this step's summed gradient of ``param`` is. In bf16 (``bf16_settings``)
    ``BF16_Optimizer``'s ``immediate_grad_update`` hook adds each micro-batch's bf16
    gradient into an fp32 buffer as soon as autograd has it and drops ``param.grad``: the
    buffer (``param._hp_grad``) is then what DeepSpeed reduces, clips and steps on."""
    if param.grad is not None:
        return param.grad
    return getattr(param, "_hp_grad", None)


def tied_embedding_copy(model: torch.nn.Module) -> torch.nn.Parameter | None:
    """This rank's copy of a word embedding tied to the output layer across pipeline stages
    (the first stage's embedding or the last stage's output layer); None elsewhere and
    without pipeline parallelism, where the two are one parameter."""
    for chunk in model_chunks(model):
        if chunk.share_embeddings_and_output_weights and chunk.pre_process != chunk.post_process:
            return chunk.shared_embedding_or_output_weight()
    return None


# -- resuming under another data-parallel size ---------------------------------------------
# A ZeRO checkpoint holds each data-parallel rank's flat partition of the fp32 master
# weights and Adam moments; DeepSpeed loads it only under the same data-parallel size.
# Its universal checkpoint (``deepspeed.checkpoint.ds_to_universal``) reassembles every
# parameter's fp32 weight and moments from all ranks' partitions, and ``load_universal``
# re-partitions them for the ranks that load it.

DS_TAG = "ds"  # the tag of each stage's DeepSpeed checkpoint (``engine/pp<stage>/ds``)


def saved_data_parallel_size(folder: Path) -> int:
    """The data-parallel size a stage's DeepSpeed checkpoint ``folder`` was saved under:
    the number of ranks that wrote optimizer files there (``[bf16_]zero_pp_rank_<dp>_
    mp_rank_<tp>_optim_states.pt``; the model-states file records it too, but beside the
    whole stage's weights)."""
    ranks = {
        match.group(1)
        for path in folder.glob("*zero_pp_rank_*_optim_states.pt")
        if (match := re.search(r"zero_pp_rank_(\d+)_mp_rank_", path.name))
    }
    if not ranks:
        raise FileNotFoundError(f"no DeepSpeed optimizer files in {folder}")
    return len(ranks)


def to_universal(source: Path, target: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` of one stage's checkpoint ``source`` into ``target``.

    ZeRO-3 goes through its ``main``. For ZeRO-1/2 (and ``BF16_Optimizer``) these are the
    steps of its ``main`` without the one that writes an fp32 file for each model-state
    entry that has no optimizer state: it calls ``.float()`` on Megatron's
    ``_extra_state`` entries, which are None. Here every parameter trains, so each has its
    optimizer state; that is checked instead.
    """
    from deepspeed.checkpoint import ds_to_universal as uc

    shutil.rmtree(target.parent, ignore_errors=True)
    args = Namespace(
        input_folder=str(source),
        output_folder=str(target),
        num_extract_workers=1,  # in this process: a training rank forks no pool
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # our checkpoints carry no universal-checkpoint info
    )
    optim_files = uc._get_optim_files(args.input_folder)
    if uc._get_zero_stage(optim_files) > 2:
        uc.main(args)
        return
    checkpoint = uc.DeepSpeedCheckpoint(args.input_folder)
    uc._inject_missing_state(checkpoint)
    slice_shapes_by_tp, _, _ = uc._aggregate_autoep_zero12_metadata(checkpoint.model_state_metadata)
    slice_shapes = uc._group_per_tp_shapes(
        slice_shapes_by_tp, checkpoint.pp_degree, checkpoint.tp_degree
    )
    temp = str(target / "tmp")
    uc._extract_zero_shard_files(args, checkpoint, temp)
    uc._merge_tp_slice_files(
        args,
        checkpoint.get_checkpoint_info(uc.UNIVERSAL_CHECKPOINT_INFO),
        checkpoint.tp_degree,
        slice_shapes,
        temp,
    )
    uc._save_optimizer_state(args, checkpoint)
    shutil.rmtree(temp, ignore_errors=True)
    missing = [name for name in slice_shapes if not (target / "zero" / name / "fp32.pt").is_file()]
    if missing:
        raise RuntimeError(f"{source} holds no optimizer state for {', '.join(sorted(missing))}")
    for model_states in checkpoint.mp_rank_files:
        shutil.copy2(model_states, target)


def _raise_on_every_rank(error: BaseException | None, what: str) -> None:
    """Collective: raise on every rank if any rank failed (with the first failure's text)."""
    gathered = gather_objects(None if error is None else f"{type(error).__name__}: {error}")
    failures = [(rank, text) for rank, text in enumerate(gathered) if text is not None]
    if failures:
        rank, text = failures[0]
        raise RuntimeError(f"{what} failed on rank {rank}: {text}") from error


class DeepSpeedEngine(Engine):
    @classmethod
    def optimizer_restart_reason(cls, saved: Layout, current: Layout, folder: Path) -> str | None:
        """Why the ZeRO state in ``folder`` (saved under ``saved``) cannot be loaded under
        ``current``, or None when it can: the same ZeRO stage and model-parallel layout, any
        data-parallel size."""
        if changed := sharding_change(saved, current):
            return changed
        if (saved.tp, saved.pp) != (current.tp, current.pp):
            return (
                "DeepSpeed's universal checkpoint reshards ZeRO's state over data-parallel "
                "ranks, but over tensor- or pipeline-parallel ranks only for models that "
                "describe how their parameters are split (Megatron-DeepSpeed's), which these "
                "Megatron-Core layers do not"
            )
        return None

    def __init__(self, model: torch.nn.Module, config: RunConfig) -> None:
        os.environ.setdefault("DS_ACCELERATOR", device().type)
        with heavy_imports():  # and frozen before its set-up collects
            import deepspeed

        cpu_bridge.skip_deepspeed_shm_op()
        self.config = config
        self.dp_size = ps.get_data_parallel_world_size()
        self.pipelined = ps.get_pipeline_model_parallel_world_size() > 1
        t = config.train
        self.num_micro_batches = t.global_batch_size // (t.micro_batch_size * self.dp_size)
        accumulation = 1 if self.pipelined else self.num_micro_batches
        self.megatron_sums = MegatronGradSums(model, config)
        parameters = sum(param.numel() for param in model.parameters())
        buckets = traffic.reduce_bucket_elements(parameters, self.dp_size)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            args=device_args(),
            model=model,
            optimizer=make_optimizer(model, config),
            config=deepspeed_config(config, accumulation, buckets),
            mpu=MegatronMpu(),
            dist_init_required=False,
        )
        check_when_to_sum_tp_grads(self.engine, self.megatron_sums.when)
        if self.megatron_sums.when is TpGradSum.BEFORE_DP_REDUCTION:
            # At PP=1 ``engine.backward`` would reduce over data parallelism inside the last
            # micro-batch's backward (``_backward_epilogue``), before the TP sums could run;
            # off, ``train_step`` calls ``allreduce_gradients`` itself after them, as
            # DeepSpeed's own PipelineEngine does (it turns the same switch off).
            self.engine.enable_backward_allreduce = False
        self.model = model

    # -- training ----------------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, micro_batches: list[Batch]) -> StepResult:
        self.engine.train()
        skipped_before = self.engine.skipped_steps
        if self.pipelined:
            loss_sum = schedule_loss_sum(
                model_chunks(self.model), micro_batches, self.config, forward_only=False
            )
            self.megatron_sums.before_data_parallel_reduction()
            self.engine.allreduce_gradients()
            self.engine.step()
        else:
            loss_sum = torch.zeros((), dtype=torch.float64, device=device())
            last = len(micro_batches) - 1
            for index, batch in enumerate(micro_batches):
                loss = lm_loss(forward(self.engine, batch), batch["loss_mask"])
                loss_sum += loss.detach().double()
                self.engine.backward(loss)
                if index == last:
                    self.at_accumulation_boundary()
                self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        return StepResult(
            loss=global_mean_loss(loss_sum, len(micro_batches)),
            grad_norm=float("nan") if grad_norm is None else float(grad_norm),
            skipped=self.engine.skipped_steps > skipped_before,
        )

    def at_accumulation_boundary(self) -> None:
        """PP=1, after the last micro-batch's ``engine.backward`` (every micro-batch's
        gradient is in) and before ``engine.step``: the TP sums where they run once a step."""
        sums = self.megatron_sums
        if sums.when is TpGradSum.BEFORE_DP_REDUCTION:
            # DeepSpeed reduces here (``enable_backward_allreduce`` off: see __init__)
            sums.before_data_parallel_reduction()
            self.engine.allreduce_gradients()
        elif sums.when is TpGradSum.AFTER_DP_REDUCTION:
            # that backward's epilogue has reduced the last gradients into the partition
            sums.after_data_parallel_reduction(self.engine.optimizer)

    def whole_weights(self) -> AbstractContextManager:
        """Under ZeRO-3 each parameter above ``stage3_param_persistence_threshold`` holds
        only an empty tensor between forwards (this rank's slice lives in DeepSpeed's
        partition): gathered here for reading, and released again on exit
        (``modifier_rank=None``: nothing is written back). Other stages: nothing to do."""
        import deepspeed

        return deepspeed.zero.GatheredParameters(
            list(self.model.parameters()),
            enabled=self.engine.zero_optimization_partition_weights(),
        )

    # -- exact resume ------------------------------------------------------------------

    def save_state(self, folder: Path) -> None:
        """Collective: DeepSpeed's engine state (weights, ZeRO optimizer) under ``folder``,
        one DeepSpeed checkpoint per pipeline stage."""
        stage = ps.get_pipeline_model_parallel_rank()
        self.engine.save_checkpoint(str(folder / f"pp{stage}"), tag=DS_TAG, save_latest=False)

    def load_state(self, folder: Path, model_folder: Path) -> None:
        """Collective. DeepSpeed's checkpoint holds the weights too, so ``model_folder``
        (the layout-free weights) is not read. Saved under another data-parallel size
        (``optimizer_restart_reason`` allows no other change), each stage's checkpoint is
        converted to DeepSpeed's universal format first and loaded from there."""
        stage = ps.get_pipeline_model_parallel_rank()
        saved = folder / f"pp{stage}"
        if saved_data_parallel_size(saved / DS_TAG) == self.dp_size:
            self.engine.load_checkpoint(str(saved), tag=DS_TAG, load_lr_scheduler_states=False)
            return
        universal = folder.parent.with_name(f"{folder.parent.name}.universal") / f"pp{stage}"
        converter = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
        error = None
        if converter:  # one conversion per pipeline stage, of all its TP ranks' files
            try:
                to_universal(saved / DS_TAG, universal / DS_TAG)
            except Exception as caught:  # every rank raises, below
                error = caught
        _raise_on_every_rank(error, f"converting {saved} to DeepSpeed's universal format")
        try:
            self._load_universal(universal)
        except Exception as caught:
            error = caught
        _raise_on_every_rank(error, f"loading the universal checkpoint {universal}")
        if converter:
            shutil.rmtree(universal, ignore_errors=True)
            if not any(universal.parent.iterdir()):
                universal.parent.rmdir()

    def _load_universal(self, folder: Path) -> None:
        """``load_checkpoint`` with DeepSpeed's ``checkpoint.load_universal`` on (the
        engine reads the setting at each call): each rank takes its data-parallel slice of
        every parameter's fp32 weight and Adam moments, then copies the fp32 weights into
        the model's own."""
        settings = self.engine._config  # DeepSpeed has no public setter for it
        settings.load_universal_checkpoint = True
        try:
            self.engine.load_checkpoint(str(folder), tag=DS_TAG, load_lr_scheduler_states=False)
        finally:
            settings.load_universal_checkpoint = False
        if self.engine.zero_optimization_partition_weights():
            self._repair_zero3_universal_load(folder / DS_TAG / "zero" / "optimizer_state.pt")

    def _repair_zero3_universal_load(self, optimizer_state: Path) -> None:
        """Two repairs after DeepSpeed 0.19.8's universal load under ZeRO-3, which

        - gives every param group the first group's settings: the vectors' group (no
          weight decay) would decay. Each group's own settings (the universal checkpoint
          keeps them all) are put back;
        - gives every sub-group's state one shared ``step`` tensor, which torch's AdamW
          advances in place once per sub-group: the bias correction would run ahead.
          Each state gets its own copy.
        """
        saved = torch.load(optimizer_state, map_location="cpu", weights_only=False)
        adam = self.engine.optimizer.optimizer
        for group, settings in zip(adam.param_groups, saved["param_groups"], strict=True):
            group.update({key: value for key, value in settings.items() if key != "params"})
        for state in adam.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    # -- evaluation --------------------------------------------------------------------

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[Batch]) -> float:
        self.engine.eval()
        if self.pipelined:
            loss_sum = schedule_loss_sum(
                model_chunks(self.model), micro_batches, self.config, forward_only=True
            )
        else:
            loss_sum = torch.zeros((), dtype=torch.float64, device=device())
            for batch in micro_batches:
                per_token = forward(self.engine, batch)
                loss_sum += lm_loss(per_token, batch["loss_mask"]).double()
        return global_mean_loss(loss_sum, len(micro_batches))
