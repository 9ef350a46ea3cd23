"""Train the planned runs one after the other, each in its own process(es).

A run that is finished (the run contract's ``run_status``: its ``metrics.jsonl`` holds a
summary line) is done and skipped; one with
checkpoints resumes from the newest complete one (the training command does that by
itself). A run folder made with other settings (another budget, preset or override) is
refused rather than resumed into a different schedule.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from cqk_megatron.atomic import write_text_atomically
from cqk_megatron.config import load_config, to_dict
from cqk_megatron.exit_codes import EXIT_REQUEUE
from cqk_megatron.ports import free_port
from cqk_megatron.repro.plan import Plan, PlannedRun
from cqk_megatron.repro.presets import ReproError
from cqk_megatron.run_folder import CHECKPOINTS, CONFIG, run_status

# Keys that may change between the first attempt and a resume without changing the run.
RESUME_NEUTRAL = {
    "log.wandb_mode",
    "log.progress_bar",
    "log.tensorboard",
    "log.tags",
    "train.exit_after_steps",
    "train.wall_clock_budget_s",
    "train.keep_last",
    "train.checkpoint_hashes",
    "data.num_workers",
    "parallel.world_size",
}


class RunStopped(ReproError):
    """A run stopped early with a checkpoint (signal, time budget, exit_after_steps)."""


def _flatten(data: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def status(run: PlannedRun) -> str:
    """``done`` (the contract's ``finished``), ``resume`` (checkpoints exist) or ``new``."""
    if run_status(run.run_dir).finished:
        return "done"
    checkpoints = run.run_dir / CHECKPOINTS
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return "resume"
    return "new"


def check_same_settings(run: PlannedRun) -> None:
    """Refuse a run folder whose saved config differs from the planned one."""
    saved_path = run.run_dir / CONFIG
    if not saved_path.is_file():
        return
    saved = _flatten(to_dict(load_config(saved_path)))
    planned = _flatten(to_dict(run.config))
    changed = [
        f"{key}: {saved.get(key)!r} -> {planned.get(key)!r}"
        for key in sorted(set(saved) | set(planned))
        if key not in RESUME_NEUTRAL and saved.get(key) != planned.get(key)
    ]
    if changed:
        raise ReproError(
            f"run folder {run.run_dir} was made with other settings ("
            + "; ".join(changed[:6])
            + (f"; and {len(changed) - 6} more" if len(changed) > 6 else "")
            + "); use another --out, or delete that folder to train it again"
        )


def write_config(run: PlannedRun, folder: Path) -> Path:
    """The resolved config the training process reads (written atomically)."""
    path = folder / f"{run.name}.yaml"
    write_text_atomically(path, yaml.safe_dump(to_dict(run.config), sort_keys=False))
    return path


def train_command(config_path: Path, nproc: int) -> list[str]:
    if nproc == 1:  # a world of one: no launcher, no rendezvous port
        return [sys.executable, "-m", "cqk_megatron.train", "--config", str(config_path)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "cqk_megatron.train",
        "--config",
        str(config_path),
    ]


def train_run(run: PlannedRun, plan: Plan, echo: bool) -> None:
    """Train (or resume) one run; its output goes to ``RUN/train.log`` and, if ``echo``, here."""
    config_path = write_config(run, plan.out / "configs")
    command = train_command(config_path, plan.nproc)
    env = dict(os.environ)
    if not plan.cuda:
        env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("PYTHONWARNINGS", "ignore")
    run.run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run.run_dir / "train.log"
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            log.flush()
            if echo:
                print(f"  [{run.name}] {line}", end="", flush=True)
        code = process.wait()
    if code == EXIT_REQUEUE:
        raise RunStopped(
            f"run {run.name} stopped early with a checkpoint (exit {code}); run the same "
            "command again to resume it"
        )
    if code != 0:
        raise ReproError(
            f"run {run.name} failed (exit {code}); its output is in {log_path}. Fix the cause "
            "and run the same command again: finished runs are kept, this one resumes"
        )
    if not run_status(run.run_dir).finished:
        raise ReproError(f"run {run.name} exited 0 but wrote no summary to {run.run_dir}")
