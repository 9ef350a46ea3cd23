"""``train.engine=megatron``, torch-free: Megatron-Core's DDP and distributed optimizer
(the engine itself: ``engines/megatron.py``)."""

from __future__ import annotations

from typing import Any

from cqk_megatron.training.engines.shardings import DISTOPT
from cqk_megatron.training.engines.spec import EngineSpec

# train.optimizer_checkpoint: Megatron's DistributedOptimizer sharding types (the default first)
OPTIMIZER_CHECKPOINTS = ("dp_reshardable", "fully_reshardable")


class MegatronSpec(EngineSpec):
    engine = "cqk_megatron.training.engines.megatron:MegatronEngine"
    shardings = {DISTOPT: 1}  # it ignores train.zero_stage; layout.json records 1
    settings = ("overlap_grad_reduce", "optimizer_checkpoint")
    checkpoint_format = "Megatron dist_checkpointing (train.optimizer_checkpoint's format)"
    gloo_groups = True  # its distributed optimizer's checkpoint formats use them

    def config_errors(self, config: Any) -> list[str]:
        t = config.train
        errors = []
        if t.precision not in ("fp32", "bf16"):
            errors.append(
                f"train.precision={t.precision!r} with train.engine=megatron: Megatron's "
                "distributed optimizer takes fp32 or bf16 parameters; use train.precision=fp32 "
                "or bf16 (or train.engine=deepspeed for fp64 checks)",
            )
        if t.offload_optimizer:
            errors.append(
                "train.offload_optimizer=true is DeepSpeed's optimizer offload; with "
                "train.engine=megatron set it to false, or use train.engine=deepspeed",
            )
        return errors

    def hardware_errors(self, config: Any, hardware: Any) -> list[str]:
        pp = config.parallel.pipeline_parallel
        if config.train.overlap_grad_reduce and pp > 1 and not hardware.cuda:
            return [
                f"train.overlap_grad_reduce=true with parallel.pipeline_parallel={pp} hangs on "
                "CPU (gloo); set train.overlap_grad_reduce=false on CPU"
            ]
        return []
