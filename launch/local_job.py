"""submitit's local executor, with a job id that ends the whole job and what a cluster's
launcher does on a failure. The one local job controller.

submitit's ``LocalExecutor`` starts its controller (``python -m submitit.local._local``)
through ``/bin/sh -c "SETUP && python ..."`` whenever there are setup lines (ours always
has some), and reports the *shell's* PID as the job id; its controller waits for *all*
tasks, so a task that dies leaves the others waiting on it, and a failed job stays failed.
This controller (a subclass: the same environment, logs and requeue code) differs:

- **The job id is the controller.** The shell ``exec``s it, so ``kill <job id>`` reaches
  it; it runs in a session of its own, and its own output (and the setup lines') goes to
  ``local_controller.log`` in the submitit folder, not to the launcher's terminal.
- **SIGTERM or SIGINT mean cancel**: it forwards SIGTERM to the tasks (they save a
  checkpoint and stop, as under Slurm's ``scancel``), neither restarts them for a requeue
  nor relaunches a failed attempt, kills any still alive after ``CANCEL_GRACE_S``
  seconds, and leaves a ``<job id>.cancelled`` file in the submitit folder so the job's
  rank 0 records "cancelled" rather than "requeued". A second one (the launcher's second
  Ctrl-C) means "now": SIGINT to the tasks, whose ranks abandon the save in progress (the
  previous complete checkpoint stays the newest) and exit 130, and whatever is left is
  killed ``STOP_NOW_GRACE_S`` later. Each task gets SIGTERM from the
  kernel if the controller itself dies (``PR_SET_PDEATHSIG``), so even ``kill -9 <job
  id>`` does not leave ranks training.
- **One failure ends the attempt** (``srun --kill-on-bad-exit=1``'s rule): when a task
  exits with a code that is not 0, 75 or submitit's requeue code, or dies of a signal,
  every other task is killed at once, with its process group (Megatron's checkpoint
  writer helper included): each task leads a session of its own for that.
- **Bounded relaunch**: the failed attempt is recorded and decided by ``launch.attempts``;
  the tasks are started again (they resume from the newest complete checkpoint) until the
  run ends, ``max_restarts`` is spent, or a failure repeats (``max_identical_failures``).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import typing as tp
from pathlib import Path

import submitit
from submitit.core import utils
from submitit.local import local as submitit_local

from cqk_megatron.training.resilience.orphans import die_with_parent
from launch import attempts
from launch import run_dir as runs

CANCEL_GRACE_S = float(os.environ.get("CQK_CANCEL_GRACE_S", "120"))
# After a second cancel: the tasks' ranks stop at once, unless one is blocked in a
# collective with a peer that already left; what is left then is killed.
STOP_NOW_GRACE_S = 10.0
CONTROLLER_MODULE = "launch.local_job"
CONTROLLER_LOG = "local_controller.log"  # the setup lines' and the controller's own output

ENV_RUN_DIR = "CQK_RUN_DIR"
ENV_MAX_RESTARTS = "CQK_MAX_RESTARTS"
ENV_MAX_IDENTICAL = "CQK_MAX_IDENTICAL_FAILURES"
ENV_MAX_REQUEUES = "CQK_MAX_REQUEUES"


def cancelled_marker(folder: Path | str, job_id: str) -> Path:
    return Path(folder) / f"{job_id}.cancelled"


def is_cancelled(folder: Path | str, job_id: str) -> bool:
    return cancelled_marker(folder, job_id).exists()


def _end_with_controller() -> None:  # runs in each task between fork and exec
    die_with_parent(signal.SIGTERM)  # not Linux: a killed controller leaves its tasks


class Controller(submitit_local.Controller):
    """submitit's controller: SIGTERM/SIGINT cancel the job; a failed attempt's tasks are
    ended and the attempt relaunched, within the policy."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.run_dir = Path(os.environ.get(ENV_RUN_DIR) or self.folder.parent)
        self.policy = attempts.Policy(
            int(os.environ.get(ENV_MAX_RESTARTS, 3)), int(os.environ.get(ENV_MAX_IDENTICAL, 2))
        )
        self.max_requeues = int(os.environ.get(ENV_MAX_REQUEUES, 10))
        self.detected_at: float | None = None
        self.cancelled = False
        signal.signal(signal.SIGTERM, self._cancel)
        signal.signal(signal.SIGINT, self._cancel)

    # -- cancel ---------------------------------------------------------------------------

    def _cancel(self, signum: int, *args: tp.Any) -> None:
        if self.cancelled:  # a second cancel (the launcher's second Ctrl-C): at once
            self._forward_signal(signal.SIGINT)  # the tasks abandon the save in progress
            self._kill_all_after(STOP_NOW_GRACE_S)
            return
        self.cancelled = True
        cancelled_marker(self.folder, self.pid).touch()
        self._kill_all_after(CANCEL_GRACE_S)
        self._forward_signal(signal.SIGTERM)  # the tasks save a checkpoint and stop

    def _kill_all_after(self, seconds: float) -> None:
        timer = threading.Timer(seconds, self._kill_all)
        timer.daemon = True
        timer.start()

    def _kill_all(self) -> None:
        for task in list(self.tasks):
            self._kill_group(task)

    # -- tasks ----------------------------------------------------------------------------

    def start_tasks(self) -> None:
        """submitit's, with each task leading a session of its own (a failed attempt's
        teardown takes its helpers with it) and bound to this controller's life."""
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
                    preexec_fn=_end_with_controller,  # after setsid: a session keeps it
                )
            )
        if self.cancelled:  # cancelled while they were starting: the late ones too
            self._forward_signal(signal.SIGTERM)

    @staticmethod
    def _kill_group(task: subprocess.Popen) -> None:
        try:
            os.killpg(task.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
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
                # A task that exited by itself between its poll and the kill was not
                # ended by this controller: its own exit code says so.
                return codes, order, [k for k in killed if codes[k] == -signal.SIGKILL]
            if not killed and any(attempts.is_bad_exit(codes[k]) for k in order):
                self.detected_at = time.time()
                for k, task in enumerate(self.tasks):
                    if task.poll() is None:
                        self._kill_group(task)
                        killed.append(k)
            elapsed = time.monotonic() - started
            if not warned and elapsed >= self.timeout_s - self.signal_delay_s:
                self._forward_signal(submitit_local.LocalJobEnvironment._usr_sig())
                warned = True
            if elapsed >= self.timeout_s:
                return [t.poll() for t in self.tasks], order, killed
            time.sleep(1.0 / freq)

    # -- attempts -------------------------------------------------------------------------

    def run(self, max_retry: int = 6) -> None:  # noqa: ARG002 - bounded by the policy instead
        requeues = 0
        while not self.cancelled:
            since = time.time()
            try:
                self.start_tasks()
                codes, order, killed = self.wait_attempt()
            finally:
                self.kill_tasks()
            if self.cancelled:
                break  # a cancelled job is neither requeued nor relaunched
            if any(c == submitit_local.LOCAL_REQUEUE_RETURN_CODE for c in codes):
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
            print(f"cqk-attempt: {attempts.attempt_line(record)}", file=sys.stderr, flush=True)
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


def _start_controller(
    folder: Path,
    command: str,
    tasks_per_node: int = 1,
    cuda_devices: str = "",
    timeout_min: float = 5.0,
    signal_delay_s: int = 30,
    stderr_to_stdout: bool = False,
    setup: tp.Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """submitit's ``start_controller``, but the shell ``exec``s our controller (its PID is
    the job id) in a new session."""
    env = dict(os.environ)
    env.update(extra_env or {})
    env.update(
        SUBMITIT_LOCAL_NTASKS=str(tasks_per_node),
        SUBMITIT_LOCAL_COMMAND=command,
        SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * timeout_min)),
        SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(signal_delay_s)),
        SUBMITIT_LOCAL_NODEID="0",
        SUBMITIT_LOCAL_JOB_NUM_NODES="1",
        SUBMITIT_STDERR_TO_STDOUT="1" if stderr_to_stdout else "",
        SUBMITIT_EXECUTOR="local",
        CUDA_VISIBLE_DEVICES=cuda_devices,
        SUBMITIT_LOCAL_WITH_SHELL="",  # exec: no shell between us and the controller
    )
    controller = shlex.join([sys.executable, "-m", CONTROLLER_MODULE, str(folder)])
    shell_command = " && ".join([*setup, f"exec {controller}"])
    # Not the launcher's stdout/stderr: a job outlives a --no-wait launcher, and pipes it
    # held open would keep the launcher's reader (a shell pipe, a test) waiting for it.
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / CONTROLLER_LOG, "a") as log:
        return subprocess.Popen(
            shell_command,
            shell=True,
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


class LocalExecutor(submitit.LocalExecutor):
    """submitit's LocalExecutor, starting ``Controller`` above. ``run_dir`` is where the
    failed attempts are recorded (default: the submitit folder's parent, ``RUN/submitit``);
    ``policy`` bounds the relaunches; ``max_num_timeout`` also bounds the requeues."""

    def __init__(
        self,
        folder: Path,
        run_dir: Path | None = None,
        policy: attempts.Policy | None = None,
        max_num_timeout: int = 3,
        python: str | None = None,
    ) -> None:
        super().__init__(folder, max_num_timeout=max_num_timeout, python=python)
        policy = policy or attempts.Policy()
        self.relaunch_env = {
            ENV_RUN_DIR: str(run_dir or Path(folder).parent),
            ENV_MAX_RESTARTS: str(policy.max_restarts),
            ENV_MAX_IDENTICAL: str(policy.max_identical_failures),
            ENV_MAX_REQUEUES: str(max_num_timeout),
        }

    def _submit_command(self, command: str) -> submitit_local.LocalJob:
        ntasks = self.parameters.get("tasks_per_node", 1)
        n_gpus = self.parameters.get("gpus_per_node", 0)
        visible_gpus = self.parameters.get("visible_gpus", ())
        gpus = range(n_gpus) if visible_gpus == () else visible_gpus[:n_gpus]
        process = _start_controller(
            folder=self.folder,
            command=command,
            tasks_per_node=ntasks,
            cuda_devices=",".join(str(k) for k in gpus),
            timeout_min=self.parameters.get("timeout_min", 2.0),
            signal_delay_s=self.parameters.get("signal_delay_s", 30),
            stderr_to_stdout=self.parameters.get("stderr_to_stdout", False),
            setup=self.parameters.get("setup", ()),
            extra_env=self.relaunch_env,
        )
        return submitit_local.LocalJob(
            folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks))
        )


def is_controller(pid: int) -> bool:
    """``pid`` is a live local job controller (ours, or submitit's own)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[1].split()[0] == "Z":
        return False  # exited, not yet reaped
    return CONTROLLER_MODULE.encode() in cmdline or b"submitit.local._local" in cmdline


if __name__ == "__main__":
    assert len(sys.argv) == 2, f"Usage: python -m {CONTROLLER_MODULE} <submitit_folder>"
    Controller(Path(sys.argv[1])).run()
