"""Train a reproduction's runs one after the other, each as a local job of the launcher
(``launch.api.submit_local``: the path of ``cqk submit --cluster local``).

A run that is finished (the run contract's ``run_status``: its ``metrics.jsonl`` holds a
summary line) is done and skipped; one with checkpoints resumes from the newest complete
one (the launcher's job does that by itself). The job is not requeued and a failed attempt
not relaunched (``max_requeues=0``, ``max_restarts=0``, as when repro ran the training
command itself): a stop with a checkpoint (exit 75) or a failure ends the command, and
running it again resumes. A run folder made with other settings (another budget, preset or
override) is refused rather than resumed into a different schedule.
"""

from __future__ import annotations

import os

from cqk_megatron.config import ConfigError, load_config, to_dict
from cqk_megatron.config.changes import flatten
from cqk_megatron.errors import EXIT_REQUEUE
from cqk_megatron.repro.configs import Reproduction, ReproRun
from cqk_megatron.repro.presets import ReproError
from cqk_megatron.run.folder import CHECKPOINTS, CONFIG, run_status

TRAIN_LOG = "train.log"  # rank 0's output, copied from the job's submitit logs
TIME_LIMIT = "3-00:00:00"  # a run's job time limit: it then stops with a checkpoint

# Keys that may change between the first attempt and a resume without changing the run.
RESUME_NEUTRAL = {
    "log.wandb_mode",
    "log.progress_bar",
    "log.tensorboard",
    "log.tags",
    "train.resilience.exit_after_steps",
    "train.resilience.wall_clock_budget_s",
    "train.checkpoint.keep_last",
    "train.checkpoint.hashes",
    "data.num_workers",
    "parallel.world_size",
}


class RunStopped(ReproError):
    """A run stopped early with a checkpoint (signal, time budget, exit_after_steps)."""


def status(run: ReproRun) -> str:
    """``done`` (the contract's ``finished``), ``resume`` (checkpoints exist) or ``new``."""
    if run_status(run.run_dir).finished:
        return "done"
    checkpoints = run.run_dir / CHECKPOINTS
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return "resume"
    return "new"


def check_same_settings(run: ReproRun) -> None:
    """Refuse a run folder whose saved config differs from the one built now."""
    saved_path = run.run_dir / CONFIG
    if not saved_path.is_file():
        return
    saved = flatten(to_dict(load_config(saved_path)))
    expected = flatten(to_dict(run.config))
    changed = [
        f"{key}: {saved.get(key)!r} -> {expected.get(key)!r}"
        for key in sorted(set(saved) | set(expected))
        if key not in RESUME_NEUTRAL and saved.get(key) != expected.get(key)
    ]
    if changed:
        raise ReproError(
            f"run folder {run.run_dir} was made with other settings ("
            + "; ".join(changed[:6])
            + (f"; and {len(changed) - 6} more" if len(changed) > 6 else "")
            + "); use another --out, or delete that folder to train it again"
        )


def train_run(
    run: ReproRun, reproduction: Reproduction, echo: bool, time_limit: str = TIME_LIMIT
) -> None:
    """Train (or resume) one run as a local job of the launcher (``launch.api``, the path
    of ``cqk submit --cluster local``); rank 0's output goes to ``RUN/train.log``
    and, if ``echo``, here. A stop with a checkpoint (exit 75, ``EXIT_REQUEUE``) raises
    ``RunStopped``; a failure ``ReproError`` naming the log."""
    from launch.api import default_cpus_per_task, submit_local, wait_local

    env = {"PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore")}
    if "OMP_NUM_THREADS" in os.environ:  # as the training process had it here before
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    run.run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run.run_dir / TRAIN_LOG
    with open(log_path, "a", encoding="utf-8") as log:

        def line(text: str) -> None:
            log.write(text)
            log.flush()
            if echo:
                print(f"  [{run.name}] {text}", end="", flush=True)

        try:
            submission = submit_local(
                run.config,
                reproduction.nproc,
                gpus=reproduction.cuda,
                time_limit=time_limit,
                cpus_per_task=None
                if reproduction.cuda
                else default_cpus_per_task(reproduction.nproc),
                env=env,
                argv=["python", "-m", "cqk_megatron.repro", f"(run {run.name})"],
            )
        except ConfigError as error:
            raise ReproError(f"run {run.name}: {error}") from error
        out, err = submission.task_logs(0)
        log.write(f"$ local job {submission.job.job_id}: rank 0's output ({out}, {err})\n")
        log.flush()
        try:
            state, code = wait_local(submission, on_line=line)
        except TimeoutError as error:
            raise RunStopped(f"{error}; run the same command again to resume it") from error
    if state == "finished":
        return
    if state == "stopped" and code == EXIT_REQUEUE:
        raise RunStopped(
            f"run {run.name} stopped early with a checkpoint (exit {code}); run the same "
            "command again to resume it"
        )
    raise ReproError(
        f"run {run.name} {state} (exit {code}); its output is in {log_path} (every rank's in "
        f"{submission.job.paths.folder}). Fix the cause and run the same command again: "
        "finished runs are kept, this one resumes"
    )
