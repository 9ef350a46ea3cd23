"""submitit's local executor, with what a cluster's launcher does on a failure.

submitit's local controller starts the tasks of a job and waits for *all* of them: a task
that dies leaves the others waiting on it (until the collective timeout), a stopped one
keeps the job forever, and a failed job stays failed. This controller (a subclass: the
same environment, logs and requeue code) adds:

- **one failure ends the attempt** (``srun --kill-on-bad-exit=1``'s rule): when a task
  exits with a code that is not 0, 75 or submitit's requeue code, or dies of a signal,
  every other task is killed at once, with its process group (Megatron's checkpoint
  writer helper included). Each task runs in a session of its own for that.
- **bounded relaunch**: the attempt is recorded and decided by ``launch.attempts``; the
  tasks are started again (and resume from the newest complete checkpoint) until the run
  ends, ``max_restarts`` is spent, or a failure repeats (``max_identical_failures``).

``RelaunchingLocalExecutor`` starts this controller instead of submitit's; the job id is
still the controller's (or its shell's) PID.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import typing as tp
from pathlib import Path

import submitit
from submitit.core import utils
from submitit.local import local

from launch import attempts
from launch import run_dir as runs

ENV_RUN_DIR = "CQK_RUN_DIR"
ENV_MAX_RESTARTS = "CQK_MAX_RESTARTS"
ENV_MAX_IDENTICAL = "CQK_MAX_IDENTICAL_FAILURES"
ENV_MAX_REQUEUES = "CQK_MAX_REQUEUES"


class Controller(local.Controller):
    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.run_dir = Path(os.environ[ENV_RUN_DIR])
        self.policy = attempts.Policy(
            int(os.environ.get(ENV_MAX_RESTARTS, 3)), int(os.environ.get(ENV_MAX_IDENTICAL, 2))
        )
        self.max_requeues = int(os.environ.get(ENV_MAX_REQUEUES, 10))
        self.detected_at: float | None = None

    def start_tasks(self) -> None:
        """submitit's, with each task leading a process group of its own."""
        self.folder.mkdir(exist_ok=True)
        paths = [utils.JobPaths(self.folder, self.pid, k) for k in range(self.ntasks)]
        self.stdouts = [p.stdout.open("a") for p in paths]
        self.stderrs = (
            self.stdouts if self.stderr_to_stdout else [p.stderr.open("a") for p in paths]
        )
        for k in range(self.ntasks):
            env = dict(os.environ)
            env.update(
                SUBMITIT_LOCAL_LOCALID=str(k),
                SUBMITIT_LOCAL_GLOBALID=str(k),
                SUBMITIT_LOCAL_JOB_ID=self.pid,
            )
            self.tasks.append(
                subprocess.Popen(
                    self.command,
                    shell=False,
                    env=env,
                    stderr=self.stderrs[k],
                    stdout=self.stdouts[k],
                    encoding="utf-8",
                    start_new_session=True,
                )
            )

    def _kill_group(self, task: subprocess.Popen) -> None:
        try:
            os.killpg(task.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill_tasks(self) -> None:
        for task in self.tasks:  # a task's helpers end with it, whatever it did
            self._kill_group(task)
        super().kill_tasks()

    def wait_attempt(self, freq: int = 20) -> tuple[list[int | None], list[int], list[int]]:
        """Until every task ended (exit codes, the order they ended in, the ones this
        controller killed). The first bad exit ends the others; the time limit works as
        in submitit (the preemption signal ``signal_delay_s`` before it)."""
        started = time.monotonic()
        warned = False
        order: list[int] = []
        killed: list[int] = []
        self.detected_at = None
        while True:
            codes = [t.poll() for t in self.tasks]
            order += [k for k, c in enumerate(codes) if c is not None and k not in order]
            if all(c is not None for c in codes):
                return codes, order, killed
            if not killed and any(attempts.is_bad_exit(codes[k]) for k in order):
                self.detected_at = time.time()
                for k, task in enumerate(self.tasks):
                    if task.poll() is None:
                        self._kill_group(task)
                        killed.append(k)
            elapsed = time.monotonic() - started
            if not warned and elapsed >= self.timeout_s - self.signal_delay_s:
                self._forward_signal(local.LocalJobEnvironment._usr_sig())
                warned = True
            if elapsed >= self.timeout_s:
                return [t.poll() for t in self.tasks], order, killed
            time.sleep(1.0 / freq)

    def run(self, max_retry: int = 6) -> None:  # noqa: ARG002 - bounded by the policy instead
        requeues = 0
        while True:
            since = time.time()
            try:
                self.start_tasks()
                codes, order, killed = self.wait_attempt()
            finally:
                self.kill_tasks()
            if any(c == local.LOCAL_REQUEUE_RETURN_CODE for c in codes):
                requeues += 1  # rank 0 asked (a stop signal, the budget): job.py bounds it
                if requeues > self.max_requeues:
                    break
                continue
            exits = {k: c for k, c in enumerate(codes) if c is not None}
            bad = [k for k in order if attempts.is_bad_exit(exits.get(k))]
            if not bad:
                break
            record = attempts.record_failure(
                self.run_dir,
                self.pid,
                self._attempt(),
                exits,
                bad[0],
                since,
                self.policy,
                hosts=dict.fromkeys(exits, socket.gethostname()),
                ended_by_launcher=killed,
                detected_at=self.detected_at,
            )
            line = attempts.attempt_lines(self.run_dir, self.pid)[-1]
            print(f"cqk-attempt: {line}", file=sys.stderr, flush=True)
            if record["decision"] != "relaunch":
                print(f"cqk-attempt: stopping: {record['why']}", file=sys.stderr, flush=True)
                break

    def _attempt(self) -> int:
        starts = [
            e
            for e in runs.events(self.run_dir)
            if e.get("event") == "started" and str(e.get("job_id")) == self.pid
        ]
        return max(len(starts), 1 + len(attempts.failures(self.run_dir, self.pid)))


class RelaunchingLocalExecutor(submitit.LocalExecutor):
    """submitit's LocalExecutor, starting ``Controller`` above."""

    def __init__(
        self,
        folder: Path,
        run_dir: Path,
        policy: attempts.Policy,
        max_num_timeout: int = 3,
        python: str | None = None,
    ) -> None:
        super().__init__(folder, max_num_timeout=max_num_timeout, python=python)
        self.relaunch_env = {
            ENV_RUN_DIR: str(run_dir),
            ENV_MAX_RESTARTS: str(policy.max_restarts),
            ENV_MAX_IDENTICAL: str(policy.max_identical_failures),
            ENV_MAX_REQUEUES: str(max_num_timeout),
        }

    def _submit_command(self, command: str) -> local.LocalJob:
        # submitit's, with this module's controller (submitit's start_controller names
        # its own module).
        ntasks = self.parameters.get("tasks_per_node", 1)
        n_gpus = self.parameters.get("gpus_per_node", 0)
        visible = self.parameters.get("visible_gpus", ())
        gpus = range(n_gpus) if visible == () else visible[:n_gpus]
        env = dict(os.environ)
        env.update(self.relaunch_env)
        env.update(
            SUBMITIT_LOCAL_NTASKS=str(ntasks),
            SUBMITIT_LOCAL_COMMAND=command,
            SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * self.parameters.get("timeout_min", 2.0))),
            SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(self.parameters.get("signal_delay_s", 30))),
            SUBMITIT_LOCAL_NODEID="0",
            SUBMITIT_LOCAL_JOB_NUM_NODES="1",
            SUBMITIT_STDERR_TO_STDOUT="1" if self.parameters.get("stderr_to_stdout") else "",
            SUBMITIT_EXECUTOR="local",
            CUDA_VISIBLE_DEVICES=",".join(str(k) for k in gpus),
            SUBMITIT_LOCAL_WITH_SHELL="1" if self.parameters.get("setup") else "",
        )
        cmd: tp.Any = [sys.executable, "-m", "launch.local_controller", str(self.folder)]
        setup = list(self.parameters.get("setup", ()))
        if setup:
            cmd = " && ".join([*setup, shlex.join(cmd)])
        process = subprocess.Popen(cmd, shell=bool(setup), env=env)
        return local.LocalJob(
            folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks))
        )


if __name__ == "__main__":
    assert len(sys.argv) == 2, "usage: python -m launch.local_controller SUBMITIT_FOLDER"
    Controller(Path(sys.argv[1])).run()
