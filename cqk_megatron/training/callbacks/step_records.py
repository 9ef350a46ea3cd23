"""The run's metrics records: a ``train`` record per logged step, the ``summary`` at the end
(``validation.py`` writes the ``valid`` records; ``training/metrics.py`` owns the file)."""

from __future__ import annotations

import hashlib
import resource
import time

import torch
import torch.distributed as dist

from cqk_megatron.config import RunConfig
from cqk_megatron.parallel.device import device
from cqk_megatron.perf.flops import flops_per_token, mfu, peak_flops
from cqk_megatron.run.folder import SUMMARY, TRAIN
from cqk_megatron.training.callbacks.base import Callback, StepOutcome, TrainingRun
from cqk_megatron.training.metrics import GPU_PEAK_ALLOCATED, MAX_RSS
from cqk_megatron.training.sampler import collate, micro_batch_indices


def peak_memory_gb() -> float:
    """GPU: peak allocated; CPU: the process's peak resident set (ru_maxrss). GiB."""
    if device().type == "cuda":
        return torch.cuda.max_memory_allocated(device()) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def memory_kind() -> str:
    """What ``peak_memory_gb`` measures here (the ``mem_kind`` of a train record)."""
    return GPU_PEAK_ALLOCATED if device().type == "cuda" else MAX_RSS


def peak_flops_per_device(config: RunConfig) -> float | None:
    """The dense peak FLOP/s that MFU divides by: ``log.peak_tflops`` where given, else the
    GPU's from its name (perf/flops.py's table); None (MFU n/a) on CPU or an unknown GPU."""
    if config.log.peak_tflops is not None:
        return config.log.peak_tflops * 1e12
    return peak_flops()


class TrainMetrics(Callback):
    """Every ``train.log_interval`` steps, and at every skipped step: loss, learning rate,
    gradient norm, throughput, MFU and memory."""

    def __init__(self, run: TrainingRun) -> None:
        self.world = dist.get_world_size()
        self.flops_per_token = flops_per_token(run.config, training=True)
        self.peak = peak_flops_per_device(run.config)

    def post_step(self, run: TrainingRun, outcome: StepOutcome) -> None:
        t, state, result = run.config.train, run.state, outcome.result
        if state.step % t.log_interval != 0 and not result.skipped:
            return
        tokens_per_s = t.global_batch_size * run.config.model.seq_length / outcome.step_time_s
        run.logger.log(
            {
                "kind": TRAIN,
                "step": state.step,
                "tokens": state.tokens,
                "loss": result.loss,
                "lr": outcome.lr,
                "grad_norm": result.grad_norm,
                "tokens_per_s": tokens_per_s,
                "step_time_s": outcome.step_time_s,
                "process_cpu_s": time.process_time(),  # cumulative, this rank
                "tflops": tokens_per_s * self.flops_per_token / self.world / 1e12,
                "mfu": mfu(tokens_per_s, run.config, self.peak, num_gpus=self.world),
                "mem_gb": peak_memory_gb(),
                "mem_kind": memory_kind(),
                "skipped": result.skipped,
            }
        )

    def close(self, run: TrainingRun) -> None:
        run.logger.close()


class RunSummary(Callback):
    """Once the run has finished (after its last save): what it trained, and a fingerprint
    of its data order. A run stopped to be requeued has no summary yet."""

    def __init__(self, params_total: int, params_non_embedding: int) -> None:
        self.params_total, self.params_non_embedding = params_total, params_non_embedding

    def post_train(self, run: TrainingRun) -> None:
        if not run.finished:
            return
        run.logger.log(
            {
                "kind": SUMMARY,
                "params_total": self.params_total,
                "params_non_embedding": self.params_non_embedding,
                "flops_per_token": flops_per_token(run.config, training=True),
                "tokens": run.state.tokens,
                "steps": run.state.step,
                "first_batch_sha256": first_batch_fingerprint(
                    run.train_data, run.config.train.global_batch_size
                ),
            }
        )


def first_batch_fingerprint(train_data, global_batch_size: int) -> str:
    """sha256 of the first global batch's tokens: runs that claim the same data order
    (a variant comparison, a layout change) can be checked to have seen the same batch."""
    indices = micro_batch_indices(0, global_batch_size, global_batch_size, 0, 1)
    digest = hashlib.sha256()
    for idx in indices:
        tokens = collate(train_data, idx)["tokens"].to(torch.int64).contiguous()
        digest.update(tokens.numpy().tobytes())
    return digest.hexdigest()
