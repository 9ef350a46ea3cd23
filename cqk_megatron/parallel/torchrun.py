"""``cqk torchrun`` (its command line: ``cli/torchrun.py``): torchrun, exiting with the
training's own code.

torchrun ends with exit 1 whenever a worker does not exit 0, and with a
``SignalException`` traceback (exit 1) when it is signalled itself, as Slurm does on
preemption or ``scontrol requeue`` (every process of the step gets SIGTERM). So a run that
saved its checkpoint and stopped with 75 ("requeue me") came out of torchrun as 1, and a
batch script that requeues on 75 never did. This wrapper runs torch's own launcher
in-process and maps its outcome back:

- every worker exited ``EXIT_REQUEUE`` (75): exit 75, also when the agent was signalled
  (each worker writes its exit code into a folder named by ``CQK_EXIT_DIR``, which is how
  the codes survive the agent's shutdown);
- a worker exited ``EXIT_WATCHDOG`` (76) or another code: that code (the first failure's,
  by time); a worker killed by a signal: 128 + signal; the agent signalled: 128 + signal.

It also gives the workers time to save when the agent is signalled (torchrun's default
``--shutdown-timeout`` is 30 s, then SIGKILL; 300 here unless given) and forwards SIGUSR1,
Slurm's time-limit warning (torchrun's default set leaves it out, and it would end the
agent). Arguments are torchrun's::

    cqk torchrun --nproc-per-node 4 -m cqk_megatron.train --config RUN.yaml
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from cqk_megatron.errors import EXIT_REQUEUE

ENV_EXIT_DIR = "CQK_EXIT_DIR"
SHUTDOWN_TIMEOUT_S = 300
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def record_exit(code: int) -> None:
    """Worker side (``cqk_megatron.train``): leave this rank's exit code for the wrapper."""
    folder = os.environ.get(ENV_EXIT_DIR)
    if folder:
        rank = os.environ.get("RANK", "0")
        try:
            Path(folder, f"rank{rank}").write_text(str(code))
        except OSError:
            pass


def _with_defaults(argv: list[str]) -> list[str]:
    options = []
    given = {a.split("=", 1)[0].replace("_", "-") for a in argv if a.startswith("--")}
    if "--shutdown-timeout" not in given:
        options += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    if "--signals-to-handle" not in given:
        options += ["--signals-to-handle", SIGNALS]
    return [*options, *argv]


def outcome(worker_codes: dict[int, int], failure_codes: list[int], signal: int | None) -> int:
    """The exit code for the job: see the module's docstring."""
    codes = list(worker_codes.values()) or failure_codes
    if codes and all(code == EXIT_REQUEUE for code in codes):
        return EXIT_REQUEUE
    bad = [c for c in failure_codes if c != 0] or [c for c in codes if c != 0]
    if bad:
        return 128 - bad[0] if bad[0] < 0 else bad[0]
    if signal is not None:
        return 128 + signal
    return 0


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    argv = _with_defaults(list(sys.argv[1:] if argv is None else argv))
    folder = tempfile.mkdtemp(prefix="cqk-torchrun-")
    os.environ[ENV_EXIT_DIR] = folder
    failures: list[int] = []
    signal = None
    try:
        torchrun_main(argv)
    except ChildFailedError as error:
        ordered = sorted(error.failures.values(), key=lambda f: f.timestamp)
        failures = [f.exitcode for f in ordered]
    except SignalException as error:
        signal = int(error.sigval)
    finally:
        workers = {}
        for path in Path(folder).glob("rank*"):
            try:
                workers[int(path.name[4:])] = int(path.read_text())
            except (OSError, ValueError):
                continue
        shutil.rmtree(folder, ignore_errors=True)
    code = outcome(workers, failures, signal)
    print(f"cqk torchrun: exit {code} (workers: {dict(sorted(workers.items()))})", flush=True)
    return code
