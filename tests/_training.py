"""Workers that run the real training loop in spawned ranks (tests only)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from _synthetic import ProgressionDataset

from cqk_megatron.config import RunConfig, load_config

TINY = [
    "model.vocab_size=64",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=32",
    "train.optimizer.lr=3e-3",
    "train.schedule.warmup_steps=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.eval_iters=2",
    "log.wandb_mode=disabled",
    # every copy a layout keeps is compared after every step (training/replicas.py)
    "train.resilience.check_replicas_interval=1",
]


def records(root: Path, name: str, kind: str) -> list[dict]:
    """The metrics records of one kind (train, valid, summary) of run ``root/name``."""
    lines = (root / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def exits(root: Path, name: str) -> list[str]:
    """What ``train_runs`` recorded for run ``name``: one exit code or error per attempt."""
    return (root / f"{name}.exit").read_text().split("\n")[:-1]


def set_rank_env(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
    )


def synthetic_datasets(config: RunConfig):
    m = config.model
    return (
        ProgressionDataset(m.vocab_size, m.seq_length, seed=0),
        ProgressionDataset(m.vocab_size, m.seq_length, seed=1),
    )


def config_for(root: str, name: str, overrides: list[str]) -> RunConfig:
    return load_config(None, [*TINY, f"name={name}", f"log.root={root}", *overrides])


def train_runs(rank, world_size, port, root, runs) -> None:
    """Train each ``(name, overrides[, resume])`` in turn; rank 0 appends the exit code
    (or the error message) to ``root/name.exit``, one line per attempt."""
    set_rank_env(rank, world_size, port)
    from cqk_megatron.training.loop import TrainingError, train

    for name, overrides, *resume in runs:
        config = config_for(root, name, overrides)
        # runs that name real data read it through build_datasets; the rest are synthetic
        datasets = None if config.data.prefixes else synthetic_datasets(config)
        try:
            outcome = str(train(config, resume=resume[0] if resume else "auto", datasets=datasets))
        except TrainingError as error:
            outcome = f"error: {error}"
        if rank == 0:
            with Path(root, f"{name}.exit").open("a") as handle:
                handle.write(outcome.replace("\n", " ") + "\n")


def save_initial_weights(rank, world_size, port, root, inits) -> None:
    """For each ``(name, overrides)``: build the TP=1 model from the seed and save it as a
    weights-only checkpoint ``root/name`` (the same start for every layout)."""
    set_rank_env(rank, world_size, port)
    import torch

    from cqk_megatron.model.gpt import build_model
    from cqk_megatron.parallel.process_groups import init_model_parallel, init_process_group
    from cqk_megatron.training import checkpoint

    init_process_group()
    for name, overrides in inits:
        config = config_for(root, name, overrides)
        init_model_parallel(config)
        torch.manual_seed(config.seed)
        checkpoint.save_weights(Path(root, name), build_model(config), config)


def folder_listing(run_dir: Path) -> dict[str, int]:
    """Every file under ``run_dir`` (lease and wandb aside) with its size."""
    if not run_dir.is_dir():
        return {}
    return {
        str(p.relative_to(run_dir)): p.stat().st_size
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != "lease.json" and "wandb" not in p.parts
    }


FILL = "fill the disk"  # a train_attempts entry (FILL, bytes): leave that much free on root


def train_attempts(rank, world_size, port, root, runs) -> None:
    """Train each ``(name, overrides[, resume])`` in turn and record, on rank 0, one JSON
    line per attempt in ``root/name.attempts.jsonl``: the exit code or the error (type and
    message), what the attempt printed, and the run folder's files afterwards. An entry
    ``(FILL, leave)`` (after a first attempt) makes rank 0 fill root's filesystem up to
    ``leave`` free bytes, in the same ranks (no second start-up)."""
    import contextlib
    import io
    import shutil

    import torch.distributed as dist

    set_rank_env(rank, world_size, port)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from cqk_megatron.training.loop import train

    for name, overrides, *resume in runs:
        if name == FILL:
            if rank == 0:
                free = shutil.disk_usage(root).free
                Path(root, "filler").write_bytes(b"\0" * (free - overrides))
            dist.barrier()
            continue
        config = config_for(root, name, overrides)
        datasets = None if config.data.prefixes else synthetic_datasets(config)
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                outcome = {
                    "exit": train(config, resume=resume[0] if resume else "auto", datasets=datasets)
                }
        except (Exception, CheckpointException) as error:  # recorded for the test to judge
            outcome = {"error": type(error).__name__, "message": str(error)}
        if rank == 0:
            outcome.update(
                stdout=out.getvalue(),
                stderr=err.getvalue(),
                files=folder_listing(Path(root, name)),
            )
            with Path(root, f"{name}.attempts.jsonl").open("a") as handle:
                handle.write(json.dumps(outcome) + "\n")


def attempts(root: Path, name: str) -> list[dict]:
    """What ``train_attempts`` recorded for run ``name``, one dict per attempt."""
    return [json.loads(line) for line in (root / f"{name}.attempts.jsonl").read_text().splitlines()]
