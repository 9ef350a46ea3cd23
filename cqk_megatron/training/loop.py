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

from cqk_megatron.config import RunConfig, validate
from cqk_megatron.data.checks import run_samples
from cqk_megatron.errors import EXIT_REQUEUE, EXIT_WATCHDOG
from cqk_megatron.model import params
from cqk_megatron.model.gpt import build_rank_model
from cqk_megatron.parallel.device import device
from cqk_megatron.parallel.process_groups import (
    RendezvousError,
    discover,
    init_model_parallel,
    init_process_group,
    seed_cuda_rng_tracker,
)
from cqk_megatron.perf.fit import check_fits, gpu_memory_bytes
from cqk_megatron.perf.flops import flops_per_token, mfu, peak_flops
from cqk_megatron.run import checkpoint_files
from cqk_megatron.run import lease as run_lease
from cqk_megatron.run.folder import CHECKPOINTS, SUMMARY, TRAIN, VALID, run_dir_of, write_config
from cqk_megatron.training import checkpoint, collectives, faults, replicas, watchdog
from cqk_megatron.training.async_save import Saver
from cqk_megatron.training.deepspeed_engine import DeepSpeedEngine
from cqk_megatron.training.engine import Engine
from cqk_megatron.training.lr_schedule import learning_rate, schedule_warning
from cqk_megatron.training.metrics import GPU_PEAK_ALLOCATED, MAX_RSS, MetricsLogger
from cqk_megatron.training.preemption import StopRequest, protect_checkpoint_writer
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


def make_engine(model: torch.nn.Module, config: RunConfig) -> Engine:
    """The data-parallel engine that ``train.engine`` names."""
    if config.train.engine == "megatron":
        from cqk_megatron.training.megatron_engine import MegatronEngine

        return MegatronEngine(model, config)
    return DeepSpeedEngine(model, config)


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


def default_datasets(config: RunConfig, train_samples: int, valid_samples: int):
    from cqk_megatron.data import build_datasets

    train, valid, _ = build_datasets(config, train_samples, valid_samples, 0)
    return train, valid


def evaluate(engine: Engine, valid_dataset, config: RunConfig, dp_rank: int, dp: int) -> float:
    t = config.train
    losses = []
    for k in range(t.eval_iters):
        indices = micro_batch_indices(
            k * t.global_batch_size, t.global_batch_size, t.micro_batch_size, dp_rank, dp
        )
        losses.append(engine.eval_loss([fetch(valid_dataset, idx) for idx in indices]))
    return sum(losses) / len(losses)


def train(config: RunConfig, resume: str = "auto", datasets=None, on_start=None) -> int:
    """Train ``config``; returns 0 when finished, ``EXIT_REQUEUE`` when stopped early,
    ``EXIT_WATCHDOG`` when a rank never arrived at rendezvous (the watchdog ends the
    process with it when a rank is lost later).

    ``resume``: see ``checkpoint_files.RESUME_HELP``. Rank 0 holds the run's lease
    (``run_lease``) from before anything is written until the end: a second job on the
    same run folder raises ``LeaseHeld`` on every rank, naming the holder. ``on_start``
    is called on rank 0 once the run really starts (its resume choice is applied).
    """
    dist_env = discover()
    faults.on_phase("rendezvous", 0, dist_env.rank)
    try:
        init_process_group(dist_env, timeout_s=config.train.init_timeout_s)
    except RendezvousError as error:
        watchdog.record_rendezvous_failure(run_dir_of(config), str(error), dist_env.rank)
        return EXIT_WATCHDOG
    with watchdog.watching(config, dist_env, run_dir_of(config)):
        return _train_leased(config, resume, datasets, on_start)


def _train_leased(config: RunConfig, resume: str, datasets, on_start) -> int:
    world = dist.get_world_size()
    validate(config, world)
    init_model_parallel(config)
    rank = dist.get_rank()
    run_dir = run_dir_of(config)
    lease = _take_lease(run_dir, rank)
    try:
        return _train(config, resume, datasets, run_dir, lease, on_start)
    finally:
        if lease is not None:
            lease.release()


def _on_rank0(step) -> None:
    """Collective: ``step()`` on rank 0; if it raised, every rank raises (the others with
    its message), so that no rank waits for one that has given up."""
    error = None
    if dist.get_rank() == 0:
        try:
            step()
        except Exception as caught:  # re-raised below, on every rank
            error = caught
    message = collectives.from_rank0(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"rank 0 failed to start the run: {message}")


def _take_lease(run_dir: Path, rank: int) -> run_lease.Lease | None:
    lease, refusal = None, None
    if rank == 0:
        try:
            lease = run_lease.acquire(run_dir)
        except (run_lease.LeaseHeld, OSError) as error:
            refusal = str(error)
    refusal = collectives.from_rank0(refusal)
    if refusal is not None:
        raise run_lease.LeaseHeld(refusal)
    return lease


RESUME_SHAPE_FIX = (
    "this run's checkpoints were saved with those values: set them back to resume it, or "
    "start a new run (another name=..., or --resume none to start this one over)"
)


def _choose_start(
    checkpoints: Path, resume: str, config: RunConfig
) -> tuple[checkpoint_files.ResumeChoice, checkpoint.ResumePlan | None]:
    """Collective: rank 0 verifies the checkpoints once, their hashing split across every
    rank (``checkpoint.rank0_with_hash_helpers``), and decides where the run starts, and
    how (``checkpoint.resume_plan``: whether the optimizer state follows a change of
    layout). A checkpoint of another model shape or global batch is refused."""

    def choose(hash_check):
        choice = checkpoint_files.choose_resume(
            checkpoints, resume, config.train.checkpoint_hashes, hash_check
        )
        plan = None
        if choice.folder is not None:
            checkpoint_files.check_same_shape(choice.folder, config, RESUME_SHAPE_FIX)
            checkpoint.check_same_global_batch(choice.folder, config)
            plan = checkpoint.resume_plan(choice.folder, config, choice.weights_only)
        return choice, plan

    chosen, error = checkpoint.rank0_with_hash_helpers(choose)
    choice, plan = chosen if chosen is not None else (None, None)
    refusal = None
    if isinstance(error, checkpoint_files.CheckpointError):
        refusal = str(error)
    elif isinstance(error, OSError):  # an unreadable checkpoints folder: every rank stops
        refusal = f"cannot read {checkpoints}: {error}"
    elif error is not None:
        raise error
    choice, plan, refusal = collectives.from_rank0((choice, plan, refusal))
    if refusal is not None:
        raise checkpoint_files.CheckpointError(refusal)
    return choice, plan


def _train(config: RunConfig, resume: str, datasets, run_dir: Path, lease, on_start) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpoints = run_dir / CHECKPOINTS
    choice, plan = _choose_start(checkpoints, resume, config)
    folder = choice.folder

    gpu_memory = gpu_memory_bytes()
    if gpu_memory:  # refuse, with the numbers, a layout that cannot fit before building it
        check_fits(config, world, gpu_memory).require()
    seed_everything(config.seed)
    model = build_rank_model(config)
    state = checkpoint.TrainerState()
    keeps_optimizer = plan is not None and plan.keeps_optimizer
    # Weights that do not come through the engine are loaded before it exists: ZeRO
    # copies them into its fp32 master weights when it is built.
    if folder is not None and not keeps_optimizer:
        checkpoint.load_model_weights(folder, model, config, RESUME_SHAPE_FIX)
        state, _ = checkpoint.load_trainer_state(folder)
    elif folder is None and config.train.init_from:
        init_from = Path(config.train.init_from)
        fix = (
            f"train.init_from={init_from} was saved with those values: use them, or point "
            "train.init_from at a checkpoint of this model's shape"
        )
        checkpoint.load_model_weights(init_from, model, config, fix)
    engine = make_engine(model, config)
    if keeps_optimizer:
        state = checkpoint.load_exact(folder, engine, plan)
    replica_check = replicas.ReplicaCheck(model, config)

    t = config.train
    seq = config.model.seq_length
    if datasets is None:
        train_samples, valid_samples, _ = run_samples(config)
        datasets = default_datasets(config, train_samples, valid_samples)
    train_data, valid_data = datasets
    # The run really starts here: only now is anything in its folder moved or replaced,
    # and only then is the metrics file opened (what an earlier attempt logged past this
    # step is superseded).
    opened = {}

    def start() -> None:
        _start_run(run_dir, config, choice, plan, state)
        if on_start is not None:
            on_start()
        opened["logger"] = MetricsLogger(run_dir, config, enabled=True)
        opened["logger"].set_start(state.step, final=state.step >= t.train_steps)

    _on_rank0(start)
    logger = opened.get("logger") or MetricsLogger(run_dir, config, enabled=False)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    train_flops_per_token = flops_per_token(config, training=True)
    peak = peak_flops_per_device(config)
    protect_checkpoint_writer()  # before any save, and before our handlers are installed
    stop = StopRequest(t.wall_clock_budget_s)
    last_saved = state.step
    saver = Saver(checkpoints, engine, model, config, lease)
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
                        "kind": TRAIN,
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
                        "mem_kind": memory_kind(),
                        "skipped": result.skipped,
                    }
                )
            if state.skipped_in_a_row >= t.max_nan_steps:
                raise TrainingError(
                    f"{state.skipped_in_a_row} steps in a row had non-finite gradients "
                    f"(last loss {result.loss}); stopping at step {state.step}. Lower train.lr, "
                    "check the data, or resume from an earlier checkpoint."
                )
            if replica_check.due(state.step):  # before this step's weights are saved
                with watchdog.phase("check_replicas"):
                    replica_check.run(state.step)
            if state.step % t.eval_interval == 0 and state.step < t.train_steps:
                log_validation(logger, engine, valid_data, config, state, dp_rank, dp)
            saver.poll(state.step)  # an asynchronous save is committed once written
            if state.step % t.save_interval == 0:
                saver.save(state)
                last_saved = state.step
            stopping = stop.agreed()  # collective: every rank, every step
            if stopping or state.step == t.exit_after_steps:
                reason = stop.local_reason() or (
                    "another rank was signalled" if stopping else "train.exit_after_steps"
                )
                if last_saved != state.step:
                    saver.save(state)
                saver.finish()  # the requeue exit waits for the save in flight
                if rank == 0:
                    print(
                        f"stopping at step {state.step} ({reason})"
                        f"; checkpoint saved, exit {EXIT_REQUEUE} to requeue",
                        flush=True,
                    )
                return EXIT_REQUEUE
        with watchdog.phase("check_replicas"):
            replica_check.at_end(state.step)
        log_validation(logger, engine, valid_data, config, state, dp_rank, dp, final=True)
        if last_saved != state.step:
            saver.save(state)
        saver.finish()
        logger.log(
            {
                "kind": SUMMARY,
                "params_total": params.total_parameters(config),
                "params_non_embedding": params.non_embedding_parameters(config),
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


def _start_run(run_dir: Path, config: RunConfig, choice, plan, state) -> None:
    """Rank 0, once the run is certain to start (before its first step): set superseded
    files aside, say where it starts and whether the optimizer state came with it (a
    warning when a change of layout restarts it), warn of a changed schedule, and record
    the config it runs with."""
    folder = choice.folder
    for reason in choice.refused:
        print(f"skipping checkpoint: {reason}", file=sys.stderr)
    (run_dir / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    moved = checkpoint_files.apply_choice(run_dir, choice)
    if moved:
        print(moved, file=sys.stderr, flush=True)
    if folder is not None:
        if choice.weights_only:
            how = "weights and trainer state only, as asked: fresh optimizer"
        else:
            how = plan.describe()
        print(f"resumed from {folder} at step {state.step} ({how})", flush=True)
        if not plan.keeps_optimizer and not choice.weights_only:
            print(
                f"warning: the optimizer restarts from zero moments at step {state.step}: "
                f"{plan.reason}. To keep it, resume in the saved layout "
                f"({plan.saved.describe_sizes()} {plan.saved.optimizer_sharding})",
                file=sys.stderr,
                flush=True,
            )
        warning = schedule_warning(folder, config, state.step)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    write_config(run_dir, config)


def first_batch_fingerprint(train_data, global_batch_size: int) -> str:
    """sha256 of the first global batch's tokens: runs that claim the same data order
    (a variant comparison, a layout change) can be checked to have seen the same batch."""
    indices = micro_batch_indices(0, global_batch_size, global_batch_size, 0, 1)
    digest = hashlib.sha256()
    for idx in indices:
        tokens = collate(train_data, idx)["tokens"].to(torch.int64).contiguous()
        digest.update(tokens.numpy().tobytes())
    return digest.hexdigest()


def log_validation(
    logger, engine: Engine, valid_data, config, state, dp_rank, dp, final=False
) -> None:
    with watchdog.phase("eval"):
        loss = evaluate(engine, valid_data, config, dp_rank, dp)
    record = {
        "kind": VALID,
        "step": state.step,
        "tokens": state.tokens,
        "val_loss": loss,
        "val_ppl": math.exp(min(loss, 50.0)),
    }
    if final:
        record["final"] = True
    logger.log(record)
