"""``launch/submit.py status RUN`` reports what happened and nothing else, after three
real local jobs (``--cluster local``: no Slurm needed) that once made it claim work that
never happened:

- a twin submission of a run that another job holds: its job is refused before training,
  so it redid and lost nothing (it said "25 steps redone ... lost", the steps the other
  job trained meanwhile), the run is not failed (it said "finished no: failed" until the
  holder logged again), its launcher exits 2 (refused; it said 1, "not finished"), and
  ``cancel RUN`` ends the holder's job (it sent SIGTERM to the holder's rank 0, whose
  controller then restarted it, while cancel said "the run is free");
- a killed rank with ``--max-restarts 0``: nothing was relaunched, so nothing was redone
  (it said "11 steps redone in all");
- ``kill -9`` of the local job's controller: its tasks save and stop, and nothing starts
  them again (the record said "requeue: requeued").
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from test_cancel import job_processes

REPO = Path(__file__).resolve().parent.parent
SUBMIT = [sys.executable, str(REPO / "launch" / "submit.py")]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
TIMEOUT_S = 420  # a shared 2-core machine; nothing here asserts on time
HOST = socket.gethostname()
# A second launcher that checked the run before the first one's job was recorded: what
# two submissions of one run at the same moment do (triage and pre-flight both passed).
RACING_LAUNCHER = """
import sys
from launch import submit
submit.triage = lambda spec: None
sys.exit(submit.main(sys.argv[1:]))
"""


def run_args(root: Path, name: str, steps: int, *extra: str) -> list[str]:
    return [
        "--config",
        "configs/runs/tiny_cpu.yaml",
        "--profile",
        "configs/clusters/local.yaml",
        "--cluster",
        "local",
        "--tasks",
        "1",
        f"log.root={root}",
        f"name={name}",
        f"train.train_steps={steps}",
        "train.checkpoint.save_interval=10",
        *extra,
    ]


def launch(*args: str, env: dict | None = None, prefix: tuple[str, ...] = ()) -> tuple[int, str]:
    """A launcher's exit code and output (to a file: a pipe would stay open as long as a
    job it started holds it)."""
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"launcher-{os.getpid()}-{time.time_ns()}.log"
    try:
        with log.open("w") as out:
            process = subprocess.run(
                [*(prefix or SUBMIT), *args],
                cwd=REPO,
                env={**ENV, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=TIMEOUT_S,
            )
        return process.returncode, log.read_text()
    finally:
        log.unlink(missing_ok=True)


def status(run_dir: Path) -> str:
    return subprocess.run(
        [*SUBMIT, "status", str(run_dir)], cwd=REPO, env=ENV, capture_output=True, text=True
    ).stdout


def events(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "jobs.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == event]


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return sum('"kind": "train"' in line for line in lines)


def wait_until(condition, what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.25)
    raise AssertionError(f"gave up waiting for {what}")


def start_job(root: Path, name: str) -> str:
    """A long local job, not waited for; its job id."""
    code, output = launch(*run_args(root, name, 100_000), "--no-wait")
    match = re.search(rf"submitted {name}: job (\d+) \(local\)", output)
    assert code == 0 and match, output
    wait_until(lambda: steps_logged(root / name) >= 3, "the first steps")
    return match.group(1)


def end_every_process(run_dir: Path) -> None:
    for pid in job_processes(run_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_refused_twin_submission_reports_its_refusal_and_no_work(tmp_path):
    root = tmp_path / "runs"
    run_dir = root / "twin"
    try:
        holder = start_job(root, "twin")
        code, output = launch(
            *run_args(root, "twin", 100_000),
            "--skip-preflight",  # it would see the lease: the race passed it too
            prefix=(sys.executable, "-c", RACING_LAUNCHER),
        )
        twin = re.search(r"submitted twin: job (\d+) \(local\)", output).group(1)
        # refused after it was queued: the launcher says refused (2), as its pre-flight
        # would have, not "not finished" (1)
        assert code == 2, output
        assert f"refused: twin: run folder {run_dir} is in use by another job" in output, output
        assert "not finished" not in output, output
        assert steps_logged(run_dir) >= 3  # the holder trained meanwhile
        (failed,) = events(run_dir, "failed")
        assert failed["job_id"] == twin and failed["decision"] == "stop"
        assert (failed["step_reached"], failed["work_lost_steps"]) == (None, 0)
        report = status(run_dir)
        assert f"job        {twin} (local): FINISHED, attempt 1" in report, report
        assert f"held by    job {holder}, host {HOST}" in report, report
        assert re.search(
            rf"refused    job {twin}: run folder {run_dir} is in use by another job "
            rf"\(job {holder}, host {HOST}",
            report,
        ), report
        # it trained nothing: no failed attempt, nothing redone or lost
        for claim in ("failures", "redone", "lost", "restarted"):
            assert claim not in report, report
        assert "finished   no (partial)" in report, report  # the holder trains on

        # cancel ends the holder's job (the last submission is the refused twin): its
        # controller stops the tasks and restarts nothing, so the run is really free
        starts = len(events(run_dir, "started"))
        out = subprocess.run(
            [*SUBMIT, "cancel", str(run_dir)],
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"SIGTERM to local job {holder}" in out.stdout, out.stdout
        assert "the run is free" in out.stdout, out.stdout
        assert not job_processes(run_dir)
        (stopped,) = events(run_dir, "stopped")
        assert (stopped["job_id"], stopped["requeue"]) == (holder, "cancelled: not requeued")
        assert len(events(run_dir, "started")) == starts  # nothing was restarted
    finally:
        end_every_process(run_dir)


def test_with_relaunches_off_status_says_nothing_was_relaunched_or_redone(tmp_path):
    root = tmp_path / "runs"
    run_dir = root / "no-relaunch"
    code, output = launch(
        *run_args(root, "no-relaunch", 40),
        "--max-restarts",
        "0",
        env={"CQK_FAULT": "rank=0,phase=step,step=15,action=kill"},
    )
    assert code == 1 and "not finished: no-relaunch" in output, output
    (failed,) = events(run_dir, "failed")
    assert failed["decision"] == "stop" and failed["checkpoint_step"] == 10
    lost = failed["work_lost_steps"]
    assert lost == failed["step_reached"] - 10 > 0  # trained past the checkpoint, then killed
    assert len(events(run_dir, "started")) == 1
    report = status(run_dir)
    assert "failures   1, not relaunched\n" in report, report
    assert "redone" not in report and "restarted" not in report, report
    assert (
        f"  - attempt 1: rank 0 on {HOST} killed by signal 9 (SIGKILL) after step "
        f"{failed['step_reached']}; not relaunched: relaunched 0 times already "
        f"(max_restarts=0) ({lost} steps since the last checkpoint lost)"
    ) in report, report


def test_after_kill_9_of_the_local_controller_nothing_is_said_to_be_requeued(tmp_path):
    root = tmp_path / "runs"
    run_dir = root / "orphaned"
    try:
        job_id = start_job(root, "orphaned")
        os.kill(int(job_id), signal.SIGKILL)
        # the kernel sends the task SIGTERM (PR_SET_PDEATHSIG): it saves and stops
        wait_until(lambda: not job_processes(run_dir), "the orphaned task to end")
        (stopped,) = events(run_dir, "stopped")
        assert stopped["exit"] == 75
        assert stopped["requeue"] == (
            f"not requeued: the job's controller (job {job_id}) is gone; submit the same "
            "command again to resume"
        )
        done = steps_logged(run_dir)
        time.sleep(2)
        assert steps_logged(run_dir) == done and len(events(run_dir, "started")) == 1
        report = status(run_dir)
        assert f"last stop  exit 75, requeue: {stopped['requeue']}" in report, report
        assert "requeue: requeued" not in report and "checkpoint saved; requeue: not" in report
    finally:
        end_every_process(run_dir)
