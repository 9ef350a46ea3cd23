"""``train.engine=deepspeed``, torch-free: DeepSpeed ZeRO over Megatron-Core's model
parallelism (the engine itself: ``engines/deepspeed.py``)."""

from __future__ import annotations

from typing import Any

from cqk_megatron.training.engines.megatron_spec import OPTIMIZER_CHECKPOINTS
from cqk_megatron.training.engines.shardings import ZERO1, ZERO2, ZERO3
from cqk_megatron.training.engines.spec import EngineSpec


class DeepSpeedSpec(EngineSpec):
    engine = "cqk_megatron.training.engines.deepspeed:DeepSpeedEngine"
    shardings = {ZERO1: 1, ZERO2: 2, ZERO3: 3}
    settings = ("zero_stage", "offload_optimizer", "overlap_grad_reduce")
    checkpoint_format = "DeepSpeed ZeRO, one checkpoint per pipeline stage"

    def offloads(self, config: Any) -> bool:
        return bool(config.train.offload_optimizer)

    def config_errors(self, config: Any) -> list[str]:
        return [message for ok, message in _rules(config) if not ok]


def _rules(config: Any) -> list[tuple[bool, str]]:
    """(holds, message) for each of DeepSpeed's rules (``tied``: model.tie_embeddings)."""
    t, pp, tied = config.train, config.parallel.pipeline_parallel, config.model.tie_embeddings
    return [
        (
            pp == 1 or t.zero_stage == 1,
            f"train.zero_stage={t.zero_stage} with parallel.pipeline_parallel={pp}: ZeRO-2/3 "
            "reduce gradients inside each backward, which Megatron's pipeline schedule drives "
            "itself; use train.zero_stage=1 with pipeline parallelism",
        ),
        (
            not (t.overlap_grad_reduce and pp > 1),
            f"train.overlap_grad_reduce=true with train.engine=deepspeed and "
            f"parallel.pipeline_parallel={pp}: DeepSpeed's overlap_comm reduces gradients in "
            "hooks inside each backward, which Megatron's pipeline schedule drives itself "
            "(DeepSpeed's own pipeline engine turns it off); set train.overlap_grad_reduce=false, "
            "or use train.engine=megatron",
        ),
        (
            not (t.offload_optimizer and pp > 1 and tied),
            f"train.offload_optimizer=true with model.tie_embeddings=true and "
            f"parallel.pipeline_parallel={pp}: DeepSpeed's offloading optimizer reduces each "
            "gradient in hooks inside the backward, before the first and last stages' copies "
            "of the tied embedding can be summed; set model.tie_embeddings=false, or "
            "train.offload_optimizer=false",
        ),
        (
            not (
                t.overlap_grad_reduce
                and t.precision == "bf16"
                and t.zero_stage == 1
                and not t.offload_optimizer
            ),
            "train.overlap_grad_reduce=true with train.engine=deepspeed, train.zero_stage=1 and "
            "train.precision=bf16 would do nothing: with fp32 gradient sums DeepSpeed runs "
            "ZeRO-1 in bf16 as its BF16_Optimizer, which reduces after the backward; use "
            "train.zero_stage=2 (gradients reduce-scattered during the backward), or "
            "train.engine=megatron, or set train.overlap_grad_reduce=false",
        ),
        (
            t.optimizer_checkpoint == OPTIMIZER_CHECKPOINTS[0],
            f"train.optimizer_checkpoint={t.optimizer_checkpoint} applies to "
            "train.engine=megatron only (DeepSpeed saves ZeRO's own format); set it to "
            f"{OPTIMIZER_CHECKPOINTS[0]}",
        ),
        (
            not (
                config.transformer_impl == "transformer_engine"
                and config.parallel.sequence_parallel
            ),
            "transformer_impl=transformer_engine with parallel.sequence_parallel=true and "
            "train.engine=deepspeed: Transformer Engine's norms leave the sum of their "
            "sequence-parallel gradients to Megatron's finalize_model_grads, which only "
            "train.engine=megatron runs; use train.engine=megatron, or transformer_impl=local",
        ),
    ]
