"""The training loop: one function from a validated config to a finished (or requeued) run.

``train`` sets up (rendezvous, the watchdog, the lease, the start: fresh or resumed, the
model and its engine); ``run_loop`` then runs the step and, around it, the callbacks of
``callbacks_in_order`` (metrics, validation, checkpoints, stop and requeue, the watchdog's
phases): see docs/training.md, "The training loop and its callbacks".
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from cqk_megatron.config import RunConfig, validate
from cqk_megatron.config.changes import new_run_fix
from cqk_megatron.data.checks import run_samples
from cqk_megatron.errors import EXIT_REQUEUE, EXIT_WATCHDOG
from cqk_megatron.model import params
from cqk_megatron.model.gpt import build_rank_model
from cqk_megatron.parallel.process_groups import (
    RendezvousError,
    discover,
    init_model_parallel,
    init_process_group,
    seed_cuda_rng_tracker,
)
from cqk_megatron.perf.fit import check_fits, gpu_memory_bytes
from cqk_megatron.run import checkpoint_files
from cqk_megatron.run import lease as run_lease
from cqk_megatron.run.folder import CHECKPOINTS, run_dir_of
from cqk_megatron.training import checkpoint, collectives, replicas
from cqk_megatron.training.async_save import Saver
from cqk_megatron.training.callbacks.base import (
    Callback,
    Callbacks,
    CallbackStates,
    StepOutcome,
    TrainingRun,
)
from cqk_megatron.training.callbacks.checkpointing import Checkpointing
from cqk_megatron.training.callbacks.divergence import NonFiniteGuard, TrainingError
from cqk_megatron.training.callbacks.records import RunRecords
from cqk_megatron.training.callbacks.replica_check import ReplicaChecks
from cqk_megatron.training.callbacks.step_records import RunSummary, TrainMetrics
from cqk_megatron.training.callbacks.stop import StopAndRequeue
from cqk_megatron.training.callbacks.validation import Validation
from cqk_megatron.training.callbacks.watchdog_phase import WatchdogPhases
from cqk_megatron.training.collector import freeze_long_lived
from cqk_megatron.training.engines import engine_class
from cqk_megatron.training.engines.protocol import Engine
from cqk_megatron.training.lr_schedule import learning_rate, schedule_warning
from cqk_megatron.training.metrics import MetricsLogger
from cqk_megatron.training.resilience import faults, watchdog
from cqk_megatron.training.sampler import fetch, micro_batch_indices

# ``train`` raises TrainingError (callers catch it from here).
__all__ = ["TrainingError", "make_engine", "seed_everything", "train"]


def seed_everything(seed: int) -> None:
    """Megatron's convention: a different seed per pipeline stage, the same across TP/DP."""
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    seed_cuda_rng_tracker(seed)  # GPU: the states Megatron's layers initialise under


def make_engine(model: torch.nn.Module, config: RunConfig) -> Engine:
    """The data-parallel engine that ``train.engine`` names (its registered class)."""
    return engine_class(config.train.engine)(model, config)


def default_datasets(config: RunConfig, train_samples: int, valid_samples: int):
    from cqk_megatron.data import build_datasets

    train, valid, _ = build_datasets(config, train_samples, valid_samples, 0)
    return train, valid


def train(
    config: RunConfig,
    resume: str = "auto",
    datasets=None,
    on_start=None,
    callbacks: Sequence[Callback] = (),
) -> int:
    """Train ``config``; returns 0 when finished, ``EXIT_REQUEUE`` when stopped early,
    ``EXIT_WATCHDOG`` when a rank never arrived at rendezvous (the watchdog ends the
    process with it when a rank is lost later).

    ``resume``: see ``checkpoint_files.RESUME_HELP``. Rank 0 holds the run's lease
    (``run_lease``) from before anything is written until the end: a second job on the
    same run folder raises ``LeaseHeld`` on every rank, naming the holder. ``on_start``
    is called on rank 0 once the run really starts (its resume choice is applied).
    ``callbacks`` are added to the loop's own, after validation and before the checkpoint
    save (``callbacks_in_order``); their ``state_dict`` is saved in every checkpoint and
    restored on resume. Every rank passes the same callbacks.
    """
    freeze_long_lived()  # the modules imported so far
    dist_env = discover()
    faults.on_phase("rendezvous", 0, dist_env.rank)
    try:
        init_process_group(dist_env, timeout_s=config.train.resilience.init_timeout_s)
    except RendezvousError as error:
        watchdog.record_rendezvous_failure(run_dir_of(config), str(error), dist_env.rank)
        return EXIT_WATCHDOG
    with watchdog.watching(config, dist_env, run_dir_of(config)):
        return _train_leased(config, resume, datasets, on_start, callbacks)


def _train_leased(
    config: RunConfig, resume: str, datasets, on_start, added: Sequence[Callback]
) -> int:
    world = dist.get_world_size()
    validate(config, world)
    init_model_parallel(config)
    rank = dist.get_rank()
    run_dir = run_dir_of(config)
    lease = _take_lease(run_dir, rank)
    try:
        return _train(config, resume, datasets, run_dir, lease, on_start, added)
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


def _resume_model_fix(config: RunConfig, folder: Path) -> str:
    return "this run's checkpoints were saved with those values: " + new_run_fix(
        config.name, str(folder)
    )


def _choose_start(
    checkpoints: Path, resume: str, config: RunConfig
) -> tuple[checkpoint_files.ResumeChoice, checkpoint.ResumeMode | None]:
    """Collective: rank 0 verifies the checkpoints once, their hashing split across every
    rank (``checkpoint.rank0_with_hash_helpers``), and decides where the run starts, and
    how (``checkpoint.resume_mode``: whether the optimizer state follows a change of
    layout). A checkpoint of another model shape or global batch is refused."""

    def choose(hash_check):
        choice = checkpoint_files.choose_resume(
            checkpoints, resume, config.train.checkpoint.hashes, hash_check
        )
        mode = None
        if choice.folder is not None:
            checkpoint_files.check_same_shape(choice.folder, config, RESUME_SHAPE_FIX)
            if not choice.weights_only:  # weights only: a new run may start from them
                fix = _resume_model_fix(config, choice.folder)
                checkpoint_files.check_same_model(choice.folder, config, fix)
            checkpoint.check_same_global_batch(choice.folder, config)
            mode = checkpoint.resume_mode(choice.folder, config, choice.weights_only)
        return choice, mode

    chosen, error = checkpoint.rank0_with_hash_helpers(choose)
    choice, mode = chosen if chosen is not None else (None, None)
    refusal = None
    if isinstance(error, checkpoint_files.CheckpointError):
        refusal = str(error)
    elif isinstance(error, OSError):  # an unreadable checkpoints folder: every rank stops
        refusal = f"cannot read {checkpoints}: {error}"
    elif error is not None:
        raise error
    choice, mode, refusal = collectives.from_rank0((choice, mode, refusal))
    if refusal is not None:
        raise checkpoint_files.CheckpointError(refusal)
    return choice, mode


def _train(
    config: RunConfig,
    resume: str,
    datasets,
    run_dir: Path,
    lease,
    on_start,
    added: Sequence[Callback] = (),
) -> int:
    choice, mode = _choose_start(run_dir / CHECKPOINTS, resume, config)
    model, engine, state, params = _build_model_and_engine(config, choice.folder, mode)
    replica_check = replicas.ReplicaCheck(model, config)
    if datasets is None:
        train_samples, valid_samples, _ = run_samples(config)
        datasets = default_datasets(config, train_samples, valid_samples)
    train_data, valid_data = datasets
    logger = _open_metrics(run_dir, config, choice, mode, state, on_start)
    run = TrainingRun(
        config,
        state,
        engine,
        train_data,
        valid_data,
        logger,
        dp_rank=ps.get_data_parallel_rank(),
        dp=ps.get_data_parallel_world_size(),
    )
    saver = Saver(run_dir / CHECKPOINTS, engine, model, config, lease)
    freeze_long_lived()  # the model, its engine, the datasets and the modules they imported
    records = RunRecords(run_dir, state.step)
    CallbackStates(added).restore(state)  # before any hook: resumed where it was saved
    ordered = callbacks_in_order(run, records, replica_check, saver, params, added)
    return run_loop(run, ordered)


def callbacks_in_order(
    run: TrainingRun,
    records: RunRecords,
    replica_check: replicas.ReplicaCheck,
    saver: Saver,
    params: tuple[int, int],
    added: Sequence[Callback] = (),
) -> Callbacks:
    """The loop's callbacks; each hook runs on them in this order (docs/training.md)."""
    return Callbacks(
        [
            TrainMetrics(run),  # the step's record first: it shows a step that then fails
            records,  # the settings this attempt's first step ran under
            NonFiniteGuard(),
            ReplicaChecks(replica_check),  # before this step's weights are saved
            Validation(),
            *added,  # the caller's: they see the step's validation, and are saved with it
            CallbackStates(added),  # their state, for the save just below
            Checkpointing(saver, run),
            StopAndRequeue(),  # after the save it may ask for: the exit waits for it
            RunSummary(*params),  # after the last save: a summary means a finished run
            WatchdogPhases(),  # "shutdown" once everything above is done
        ]
    )


def run_loop(run: TrainingRun, callbacks: Callbacks) -> int:
    """The steps and their hooks: 0 when every step is trained, ``EXIT_REQUEUE`` when a
    callback asked to stop early (``run.stop_reason``)."""
    try:
        callbacks.pre_train(run)
        while run.state.step < run.config.train.train_steps and run.stop_reason is None:
            callbacks.pre_step(run)
            outcome = train_step(run)
            callbacks.post_step(run, outcome)
        callbacks.post_train(run)
        return 0 if run.stop_reason is None else EXIT_REQUEUE
    except BaseException as error:
        callbacks.on_error(run, error)
        raise
    finally:
        callbacks.close(run)


def train_step(run: TrainingRun) -> StepOutcome:
    """One optimizer step on the next global batch (this rank's micro-batches of it)."""
    t, state, engine = run.config.train, run.state, run.engine
    lr = learning_rate(state.step, t)
    engine.set_lr(lr)
    indices = micro_batch_indices(
        state.consumed_samples, t.global_batch_size, t.micro_batch_size, run.dp_rank, run.dp
    )
    started = time.perf_counter()
    with watchdog.phase("data"):
        batch = [fetch(run.train_data, idx) for idx in indices]
    result = engine.train_step(batch)
    step_time = time.perf_counter() - started
    state.step += 1
    state.consumed_samples += t.global_batch_size
    state.tokens += t.global_batch_size * run.config.model.seq_length
    state.skipped_in_a_row = state.skipped_in_a_row + 1 if result.skipped else 0
    return StepOutcome(lr, result, step_time)


def _build_model_and_engine(
    config: RunConfig, folder: Path | None, mode: checkpoint.ResumeMode | None
) -> tuple[torch.nn.Module, Engine, checkpoint.TrainerState, tuple[int, int]]:
    """This rank's model and engine, with the resumed (or ``train.init_from``) weights and
    optimizer state, the trainer state to start from, and the (total, non-embedding)
    parameter counts."""
    gpu_memory = gpu_memory_bytes()
    if gpu_memory:  # refuse, with the numbers, a layout that cannot fit before building it
        check_fits(config, dist.get_world_size(), gpu_memory).require()
    seed_everything(config.seed)
    model = build_rank_model(config)
    state = checkpoint.TrainerState()
    keeps_optimizer = mode is not None and mode.keeps_optimizer
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
    counts = (params.total_parameters(config), params.non_embedding_parameters(config))
    engine = make_engine(model, config)
    if keeps_optimizer:
        state = checkpoint.load_exact(folder, engine, mode)
    return model, engine, state, counts


def _open_metrics(run_dir: Path, config: RunConfig, choice, mode, state, on_start) -> MetricsLogger:
    """Collective: the run really starts here. Only now is anything in its folder moved
    or replaced (rank 0, ``_start_run``), and only then is the metrics file opened (what
    an earlier attempt logged past this step is superseded). Rank 0's logger writes; the
    others' do nothing."""
    opened = {}

    def start() -> None:
        _start_run(run_dir, config, choice, mode, state)
        if on_start is not None:
            on_start()
        opened["logger"] = MetricsLogger(run_dir, config, enabled=True)
        opened["logger"].set_start(state.step, final=state.step >= config.train.train_steps)

    _on_rank0(start)
    return opened.get("logger") or MetricsLogger(run_dir, config, enabled=False)


def _start_run(run_dir: Path, config: RunConfig, choice, mode, state) -> None:
    """Rank 0, once the run is certain to start (before its first step): set superseded
    files aside, say where it starts and whether the optimizer state came with it (a
    warning when a change of layout restarts it) and warn of a changed schedule. Its
    config is recorded after its first step (``RunRecords``)."""
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
            how = mode.describe()
        print(f"resumed from {folder} at step {state.step} ({how})", flush=True)
        if not mode.keeps_optimizer and not choice.weights_only:
            print(
                f"warning: the optimizer restarts from zero moments at step {state.step}: "
                f"{mode.reason}. To keep it, resume in the saved layout "
                f"({mode.saved.describe_sizes()} {mode.saved.optimizer_sharding})",
                file=sys.stderr,
                flush=True,
            )
        warning = schedule_warning(folder, config, state.step)
        if warning:
            print(warning, file=sys.stderr, flush=True)
