"""submitit's local executor, with a job id that ends the whole job.

submitit's ``LocalExecutor`` starts its controller (``python -m submitit.local._local``)
through ``/bin/sh -c "SETUP && python ..."`` whenever there are setup lines (ours always
has some), and reports the *shell's* PID as the job id. ``kill <job id>`` then ends only
the shell: the controller and every task train on, and the launcher, seeing the shell
gone, calls the job INTERRUPTED and lets a second job start on the same run.

Here the shell ``exec``s the controller, so the printed job id *is* the controller, which
runs in a session of its own (``kill -- -<job id>`` reaches every process of the job) and
treats SIGTERM or SIGINT as *cancel*: it forwards SIGTERM to the tasks (they save a
checkpoint and stop, as under Slurm's ``scancel``), does not restart them for a requeue,
kills any still alive after ``CANCEL_GRACE_S`` seconds, and leaves a ``<job id>.cancelled``
file in the submitit folder so the job's rank 0 records "cancelled" rather than
"requeued". Its own output (and the setup lines') goes to ``local_controller.log`` in the
submitit folder, not to the launcher's terminal. Each task gets SIGTERM from the kernel
if the controller itself dies (``PR_SET_PDEATHSIG``), so even ``kill -9 <job id>`` does
not leave ranks training.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
import threading
import typing as tp
from pathlib import Path

import submitit
from submitit.core import utils
from submitit.local import local as submitit_local

CANCEL_GRACE_S = float(os.environ.get("CQK_CANCEL_GRACE_S", "120"))
CONTROLLER_MODULE = "launch.local_job"
CONTROLLER_LOG = "local_controller.log"  # the setup lines' and the controller's own output
_PR_SET_PDEATHSIG = 1


def cancelled_marker(folder: Path | str, job_id: str) -> Path:
    return Path(folder) / f"{job_id}.cancelled"


def is_cancelled(folder: Path | str, job_id: str) -> bool:
    return cancelled_marker(folder, job_id).exists()


def _die_with_parent() -> None:  # runs in each task between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: a killed controller leaves its tasks (submitit's behaviour)


class Controller(submitit_local.Controller):
    """submitit's controller; SIGTERM/SIGINT cancel the job instead of requeueing it."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.cancelled = False
        signal.signal(signal.SIGTERM, self._cancel)
        signal.signal(signal.SIGINT, self._cancel)

    def _cancel(self, signum: int, *args: tp.Any) -> None:
        if not self.cancelled:
            self.cancelled = True
            cancelled_marker(self.folder, self.pid).touch()
            timer = threading.Timer(CANCEL_GRACE_S, self._kill_all)
            timer.daemon = True
            timer.start()
        self._forward_signal(signal.SIGTERM)  # the tasks save a checkpoint and stop

    def _kill_all(self) -> None:
        self._forward_signal(signal.SIGKILL)

    def start_tasks(self) -> None:
        # submitit's start_tasks, with each task bound to this controller's life
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
                    preexec_fn=_die_with_parent,
                )
            )

    def run(self, max_retry: int = 6) -> None:
        for _ in range(max_retry):
            try:
                if self.cancelled:
                    break
                self.start_tasks()
                exit_codes = self.wait()
                requeue = any(e == submitit_local.LOCAL_REQUEUE_RETURN_CODE for e in exit_codes)
                if self.cancelled or not requeue:
                    break
            finally:
                self.kill_tasks()


def _start_controller(
    folder: Path,
    command: str,
    tasks_per_node: int = 1,
    cuda_devices: str = "",
    timeout_min: float = 5.0,
    signal_delay_s: int = 30,
    stderr_to_stdout: bool = False,
    setup: tp.Sequence[str] = (),
) -> subprocess.Popen:
    """submitit's ``start_controller``, but the shell ``exec``s our controller (its PID is
    the job id) in a new session."""
    env = dict(os.environ)
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
