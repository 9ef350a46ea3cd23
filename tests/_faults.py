"""Helpers for the fault tests: real training processes, a fault, measured outcomes.

Every process started here leads a process group of its own, and every helper that
waits has a bound past which it kills the group and fails: no test hangs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from _multiproc import free_port
from _overrides import replaced

from cqk_megatron.errors import EXIT_WATCHDOG

REPO = Path(__file__).resolve().parent.parent
# Watchdog bounds for tests: seconds, not the defaults' minutes. Start-up stays generous
# (on a loaded 2-core machine two ranks may import torch and Megatron a minute apart).
FAST = [
    "train.resilience.heartbeat_interval_s=0.5",
    "train.resilience.heartbeat_timeout_s=5",
    "train.resilience.step_timeout_s=15",
    "train.resilience.collective_timeout_s=30",
    "train.resilience.init_timeout_s=180",
]
RUN = [
    "--config",
    "configs/runs/tiny_cpu.yaml",
    "train.checkpoint.save_interval=10",
    "train.eval_interval=1000",
    "train.checkpoint.hashes=false",
    *FAST,
]
GRACE_S = 5.0
FAULT_TIME = re.compile(r"CQK_FAULT: (\w+) at t=([\d.]+)")
# A run through the launcher (submit.py) on this config: the faulted jobs of both fault
# modules, and the uninterrupted run they are compared with, bit for bit.
STEPS, SAVE_INTERVAL = 60, 10
LAUNCHED = [
    sys.executable,
    str(REPO / "launch" / "submit.py"),
    "--config",
    "configs/runs/tiny_cpu.yaml",
    "--profile",
    "configs/clusters/local.yaml",
    f"train.train_steps={STEPS}",
    f"train.checkpoint.save_interval={SAVE_INTERVAL}",
    "train.eval_interval=1000",
    "train.checkpoint.hashes=false",
    *FAST,
]
_reference: dict = {}


def start_reference(tmp_path_factory) -> None:
    """Start the uninterrupted run (2 tasks, the local launcher) once per session: both
    fault modules compare with it, and it trains while their faulted jobs do."""
    if "process" in _reference:
        return
    root = tmp_path_factory.mktemp("reference")
    _reference["run_dir"] = root / "reference"
    _reference["process"] = subprocess.Popen(
        [*LAUNCHED, "--cluster", "local", "--tasks", "2", f"log.root={root}", "name=reference"],
        cwd=REPO,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def reference_run(tmp_path_factory, timeout_s: float = 600) -> Path:
    """The uninterrupted run's folder once it has finished (started now if it was not);
    past ``timeout_s`` it is killed and this fails."""
    start_reference(tmp_path_factory)
    process = _reference["process"]
    if "output" not in _reference:
        try:
            _reference["output"] = process.communicate(timeout=timeout_s)[0]
        finally:
            if process.poll() is None:
                kill_group(process)
    assert process.returncode == 0, _reference.get("output", "")[-3000:]
    return _reference["run_dir"]


def measured(fault: str, **values) -> None:
    """One line per measurement, for docs/faults.md's table (``pytest -s ... | grep measured``)."""
    text = ", ".join(
        f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
    )
    print(f"\nmeasured: {fault}: {text}", flush=True)


def fault_times(text: str) -> list[float]:
    """When each injected fault acted (``CQK_FAULT: kill at t=...`` lines)."""
    return [float(m.group(2)) for m in FAULT_TIME.finditer(text)]


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return max(
        (json.loads(line)["step"] for line in path.read_text().splitlines() if '"train"' in line),
        default=0,
    )


def events(run_dir: Path, event: str) -> list[dict]:
    path = run_dir / "jobs.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [e for e in map(json.loads, lines) if e["event"] == event]


def faults_records(run_dir: Path) -> list[dict]:
    path = run_dir / "faults.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


@dataclass
class Ranks:
    """Plain ``python -m cqk_megatron.train`` ranks (as ``srun`` without
    ``--kill-on-bad-exit`` would start them): nothing but the watchdog ends them."""

    root: Path
    name: str
    world_size: int = 2
    env: dict = field(default_factory=dict)
    overrides: list = field(default_factory=list)
    absent: tuple = ()  # ranks never started: as if they died before rendezvous
    processes: dict = field(default_factory=dict)  # rank -> Popen
    ended: dict = field(default_factory=dict)  # rank -> (exit code, time.time())

    def start(self) -> Ranks:
        port = free_port()
        for rank in range(self.world_size):
            if rank in self.absent:
                continue
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "DS_ACCELERATOR": "cpu",
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(REPO),
                **self.env,
            }
            log = self.log(rank).open("w")
            self.processes[rank] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "cqk_megatron.train",
                    *RUN[:2],
                    f"log.root={self.root}",
                    f"name={self.name}",
                    *replaced(RUN[2:], *self.overrides),
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def run_dir(self) -> Path:
        return self.root / self.name

    def log(self, rank: int) -> Path:
        return self.root / f"{self.name}.rank{rank}.log"

    def text(self, rank: int) -> str:
        return self.log(rank).read_text(errors="replace")

    def poll(self) -> bool:
        """Record ranks that ended; True once all have. ``GRACE_S`` after a rank exited
        with the watchdog's verdict, the ones left (a stopped rank never exits by itself)
        are killed, as a launcher would."""
        for rank, process in self.processes.items():
            if rank not in self.ended and process.poll() is not None:
                self.ended[rank] = (process.returncode, time.time())
        verdicts = [at for code, at in self.ended.values() if code == EXIT_WATCHDOG]
        # A few seconds' grace first: every survivor's watchdog publishes, prints, exits.
        if verdicts and time.time() - min(verdicts) > GRACE_S:
            for rank, process in self.processes.items():
                if rank not in self.ended:
                    kill_group(process)
                    self.ended[rank] = (process.returncode, time.time())
        return len(self.ended) == len(self.processes)

    def kill(self) -> None:
        for process in self.processes.values():
            kill_group(process)


def run_all(groups: list[Ranks], actions: dict, bound_s: float) -> None:
    """Poll every group until each has ended or ``bound_s`` passes; ``actions`` maps a
    group's name to ``(condition, act)``, called once when ``condition(group)`` holds.
    Whatever still runs at the end is killed (and the caller's asserts fail)."""
    pending = dict(actions)
    deadline = time.monotonic() + bound_s
    try:
        while time.monotonic() < deadline:
            done = [group.poll() for group in groups]
            for group in groups:
                if group.name in pending and pending[group.name][0](group):
                    pending.pop(group.name)[1](group)
            if all(done):
                return
            time.sleep(0.05)
    finally:
        for group in groups:
            group.poll()
            group.kill()


def watchdog_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("watchdog: ")]
