"""The training loop: one function from a validated config to a finished (or requeued) run."""

from __future__ import annotations

import hashlib
import math
import random
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from cqk_megatron.config import RunConfig, save_config, validate
from cqk_megatron.device import device
from cqk_megatron.distributed import (
    RendezvousError,
    discover,
    init_model_parallel,
    init_process_group,
    seed_cuda_rng_tracker,
)
from cqk_megatron.exit_codes import EXIT_WATCHDOG
from cqk_megatron.model import build_rank_model
from cqk_megatron.perf.flops import flops_per_token, mfu, peak_flops
from cqk_megatron.perf.plan import check_fits, gpu_memory_bytes
from cqk_megatron.training import checkpoint, collectives, faults, watchdog
from cqk_megatron.training.engine import DeepSpeedEngine
from cqk_megatron.training.lr_schedule import learning_rate
from cqk_megatron.training.metrics import MetricsLogger
from cqk_megatron.training.preemption import (
    EXIT_REQUEUE,
    StopRequest,
    protect_checkpoint_writer,
)
from cqk_megatron.training.sampler import collate, fetch, micro_batch_indices


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. non-finite losses step after step)."""


def seed_everything(seed: int) -> None:
    """Megatron's convention: a different seed per pipeline stage, the same across TP/DP."""
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    seed_cuda_rng_tracker(seed)  # GPU: the states Megatron's layers initialise under


def make_engine(model: torch.nn.Module, config: RunConfig):
    """The data-parallel engine that ``train.engine`` names."""
    if config.train.engine == "megatron":
        from cqk_megatron.training.megatron_engine import MegatronEngine

        return MegatronEngine(model, config)
    return DeepSpeedEngine(model, config)


def run_dir_of(config: RunConfig) -> Path:
    return Path(config.log.root) / config.name


def count_model_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(total, non-embedding) parameters of the whole model, from this rank's shard."""
    tp_rank = ps.get_tensor_model_parallel_rank()
    total = non_embedding = 0
    for name, param in model.named_parameters():
        if getattr(param, "tensor_model_parallel", False) or tp_rank == 0:
            numel = getattr(param, "ds_numel", param.numel())  # ZeRO-3 partitions params
            total += numel
            if "word_embeddings" not in name and "output_layer" not in name:
                non_embedding += numel
    summed = collectives.sum_numbers([total, non_embedding], group=ps.get_model_parallel_group())
    return int(summed[0]), int(summed[1])


def peak_memory_gb() -> float:
    """GPU: peak allocated; CPU: the process's peak resident set (ru_maxrss)."""
    if device().type == "cuda":
        return torch.cuda.max_memory_allocated(device()) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def default_datasets(config: RunConfig, train_samples: int, valid_samples: int):
    from cqk_megatron.data import build_datasets

    train, valid, _ = build_datasets(config, train_samples, valid_samples, 0)
    return train, valid


def evaluate(engine, valid_dataset, config: RunConfig, dp_rank: int, dp: int) -> float:
    t = config.train
    losses = []
    for k in range(t.eval_iters):
        indices = micro_batch_indices(
            k * t.global_batch_size, t.global_batch_size, t.micro_batch_size, dp_rank, dp
        )
        losses.append(engine.eval_loss([fetch(valid_dataset, idx) for idx in indices]))
    return sum(losses) / len(losses)


def train(config: RunConfig, resume: str = "auto", datasets=None) -> int:
    """Train ``config``; returns 0 when finished, ``EXIT_REQUEUE`` when stopped early,
    ``EXIT_WATCHDOG`` when a rank never arrived at rendezvous (the watchdog ends the
    process with it when a rank is lost later)."""
    dist_env = discover()
    faults.on_phase("rendezvous", 0, dist_env.rank)
    try:
        init_process_group(dist_env, timeout_s=config.train.init_timeout_s)
    except RendezvousError as error:
        watchdog.record_rendezvous_failure(run_dir_of(config), str(error), dist_env.rank)
        return EXIT_WATCHDOG
    with watchdog.watching(config, dist_env, run_dir_of(config)):
        return _train(config, resume, datasets)


def _train(config: RunConfig, resume: str, datasets) -> int:
    world = dist.get_world_size()
    validate(config, world)
    init_model_parallel(config)
    rank = dist.get_rank()
    run_dir = run_dir_of(config)
    checkpoints = run_dir / "checkpoints"
    if rank == 0:
        checkpoints.mkdir(parents=True, exist_ok=True)
        save_config(config, run_dir / "config.yaml")
    collectives.barrier()

    gpu_memory = gpu_memory_bytes()
    if gpu_memory:  # refuse, with the numbers, a layout that cannot fit before building it
        check_fits(config, world, gpu_memory).require()
    seed_everything(config.seed)
    model = build_rank_model(config)
    state, folder = checkpoint.TrainerState(), None
    if resume == "auto":
        folder, refused = checkpoint.find_resumable(checkpoints)
        if rank == 0:
            for reason in refused:
                print(f"skipping checkpoint: {reason}", file=sys.stderr)
    elif resume != "none":
        folder = Path(resume)
        checkpoint.verify(folder)
    exact = folder is not None and checkpoint.same_layout(folder, config)
    # Weights that do not come through the engine are loaded before it exists: ZeRO
    # copies them into its fp32 master weights when it is built.
    if folder is not None and not exact:
        checkpoint.load_model_weights(folder, model)
        state, _ = checkpoint.load_trainer_state(folder)
    elif folder is None and config.train.init_from:
        checkpoint.load_model_weights(Path(config.train.init_from), model)
    params_total, params_non_embedding = count_model_parameters(model)
    engine = make_engine(model, config)
    if exact:
        state = checkpoint.load_exact(folder, engine)
    if folder is not None and rank == 0:
        how = "exactly" if exact else "weights only: the parallel layout changed, fresh optimizer"
        print(f"resumed from {folder} at step {state.step} ({how})", flush=True)

    t = config.train
    seq = config.model.seq_length
    if datasets is None:
        evaluations = t.train_steps // t.eval_interval + 1
        datasets = default_datasets(
            config,
            t.train_steps * t.global_batch_size,
            evaluations * t.eval_iters * t.global_batch_size,
        )
    train_data, valid_data = datasets
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    train_flops_per_token = flops_per_token(config, training=True)
    peak = peak_flops()
    logger = MetricsLogger(run_dir, config, enabled=rank == 0)
    logger.set_start(state.step)
    protect_checkpoint_writer()  # before any save, and before our handlers are installed
    stop = StopRequest(t.wall_clock_budget_s)
    last_saved = state.step
    try:
        while state.step < t.train_steps:
            watchdog.enter("step", state.step + 1)
            lr = learning_rate(state.step, t)
            engine.set_lr(lr)
            indices = micro_batch_indices(
                state.consumed_samples, t.global_batch_size, t.micro_batch_size, dp_rank, dp
            )
            started = time.perf_counter()
            with watchdog.phase("data"):
                batch = [fetch(train_data, idx) for idx in indices]
            result = engine.train_step(batch)
            step_time = time.perf_counter() - started
            state.step += 1
            state.consumed_samples += t.global_batch_size
            state.tokens += t.global_batch_size * seq
            state.skipped_in_a_row = state.skipped_in_a_row + 1 if result.skipped else 0
            if state.step % t.log_interval == 0 or result.skipped:
                tokens_per_s = t.global_batch_size * seq / step_time
                logger.log(
                    {
                        "kind": "train",
                        "step": state.step,
                        "tokens": state.tokens,
                        "loss": result.loss,
                        "lr": lr,
                        "grad_norm": result.grad_norm,
                        "tokens_per_s": tokens_per_s,
                        "step_time_s": step_time,
                        "process_cpu_s": time.process_time(),  # cumulative, this rank
                        "tflops": tokens_per_s * train_flops_per_token / world / 1e12,
                        "mfu": mfu(tokens_per_s, config, peak, num_gpus=world),
                        "mem_gb": peak_memory_gb(),
                        "skipped": result.skipped,
                    }
                )
            if state.skipped_in_a_row >= t.max_nan_steps:
                raise TrainingError(
                    f"{state.skipped_in_a_row} steps in a row had non-finite gradients "
                    f"(last loss {result.loss}); stopping at step {state.step}. Lower train.lr, "
                    "check the data, or resume from an earlier checkpoint."
                )
            if state.step % t.eval_interval == 0 and state.step < t.train_steps:
                log_validation(logger, engine, valid_data, config, state, dp_rank, dp)
            if state.step % t.save_interval == 0:
                with watchdog.phase("save"):
                    checkpoint.save(checkpoints, engine, model, config, state)
                last_saved = state.step
            stopping = stop.agreed()  # collective: every rank, every step
            if stopping or state.step == t.exit_after_steps:
                reason = stop.local_reason() or (
                    "another rank was signalled" if stopping else "train.exit_after_steps"
                )
                if last_saved != state.step:
                    with watchdog.phase("save"):
                        checkpoint.save(checkpoints, engine, model, config, state)
                if rank == 0:
                    print(
                        f"stopping at step {state.step} ({reason})"
                        f"; checkpoint saved, exit {EXIT_REQUEUE} to requeue",
                        flush=True,
                    )
                return EXIT_REQUEUE
        log_validation(logger, engine, valid_data, config, state, dp_rank, dp, final=True)
        if last_saved != state.step:
            with watchdog.phase("save"):
                checkpoint.save(checkpoints, engine, model, config, state)
        logger.log(
            {
                "kind": "summary",
                "params_total": params_total,
                "params_non_embedding": params_non_embedding,
                "flops_per_token": train_flops_per_token,
                "tokens": state.tokens,
                "steps": state.step,
                "first_batch_sha256": first_batch_fingerprint(train_data, t.global_batch_size),
            }
        )
        return 0
    finally:
        if sys.exc_info()[0] is None:  # an error is the watchdog's to judge, not a shutdown
            watchdog.enter("shutdown", state.step)
        stop.restore()
        logger.close()


def first_batch_fingerprint(train_data, global_batch_size: int) -> str:
    """sha256 of the first global batch's tokens: runs that claim the same data order
    (a variant comparison, a layout change) can be checked to have seen the same batch."""
    indices = micro_batch_indices(0, global_batch_size, global_batch_size, 0, 1)
    digest = hashlib.sha256()
    for idx in indices:
        tokens = collate(train_data, idx)["tokens"].to(torch.int64).contiguous()
        digest.update(tokens.numpy().tobytes())
    return digest.hexdigest()


def log_validation(logger, engine, valid_data, config, state, dp_rank, dp, final=False) -> None:
    with watchdog.phase("eval"):
        loss = evaluate(engine, valid_data, config, dp_rank, dp)
    record = {
        "kind": "valid",
        "step": state.step,
        "tokens": state.tokens,
        "val_loss": loss,
        "val_ppl": math.exp(min(loss, 50.0)),
    }
    if final:
        record["final"] = True
    logger.log(record)
