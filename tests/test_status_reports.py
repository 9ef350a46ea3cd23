"""What ``cqk status`` and a waiting ``cqk submit`` say about a cancelled job, and what
``cqk status NAME`` does when the name has two run folders.

A real local job (``--cluster local``, one rank of the tiny model) is cancelled by ``cqk
cancel`` while its launcher waits: the launcher says the job ended CANCELLED (it said
``ended (FINISHED)``: the ranks save and exit, which the local backend reads as finished)
and ``cqk status`` gives the job's state as CANCELLED.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from test_cancel import job_processes, train_steps, wait_until

from launch.run_dir import events

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 420  # a shared 2-core machine; nothing here asserts on time


def _env(state: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DS_ACCELERATOR": "cpu",
        "XDG_STATE_HOME": str(state),  # the runs index of this test only
    }


def cqk(state: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cqk_megatron", *args],
        cwd=REPO,
        env=_env(state),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def test_a_cancelled_job_is_reported_as_cancelled(tmp_path):
    root, state, log = tmp_path / "runs", tmp_path / "state", tmp_path / "launcher.log"
    run_dir = root / "to-cancel"
    with log.open("w") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "cqk_megatron", "submit", "--config",
             "configs/runs/tiny_cpu.yaml", "--cluster", "local", "--tasks", "1",
             f"log.root={root}", "name=to-cancel", "train.train_steps=100000",
             "train.checkpoint.save_interval=5", "train.checkpoint.hashes=false"],
            cwd=REPO, env=_env(state), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until(lambda: len(train_steps(run_dir)) >= 3, "the first steps")
        cancelled = cqk(state, "cancel", "to-cancel")
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
        assert launcher.wait(timeout=TIMEOUT_S) is not None
        said = log.read_text()
        (job_id,) = re.findall(r"submitted to-cancel: job (\S+) \(local\)", said)
        assert f"to-cancel: job {job_id} ended (CANCELLED)" in said, said
        status = cqk(state, "status", "to-cancel")
        assert re.search(rf"job\s+{job_id} \(local\): CANCELLED", status.stdout), status.stdout
        # the record says what was typed: cqk submit, not the script it runs
        submitted = next(e for e in events(run_dir) if e["event"] == "submitted")
        assert submitted["command"][:3] == ["cqk", "submit", "--config"], submitted["command"]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in job_processes(run_dir):
            os.kill(pid, 9)


def _remember(state: Path, name: str, run_dir: Path) -> None:
    index = state / "cqk-megatron" / "runs.jsonl"
    index.parent.mkdir(parents=True, exist_ok=True)
    with index.open("a") as file:
        file.write(json.dumps({"name": name, "run_dir": str(run_dir)}) + "\n")


def test_status_of_a_name_with_two_folders_lists_them_and_asks_for_the_path(tmp_path):
    state = tmp_path / "state"
    first, second = tmp_path / "a" / "twice", tmp_path / "b" / "twice"
    for folder in (first, second, first):  # noted again when resubmitted: still two
        folder.mkdir(parents=True, exist_ok=True)
        _remember(state, "twice", folder)
    for command in ("status", "cancel"):
        done = cqk(state, command, "twice")
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr == (
            "error: twice: 2 run folders of that name were submitted from this account:\n"
            f"  {first}\n  {second}\ngive the one you mean as a path\n"
        )
    # one folder of the name left: it is the one
    second.rmdir()
    alone = cqk(state, "status", "twice")
    assert alone.returncode == 0 and f"run        {first}" in alone.stdout, alone.stdout


def test_a_job_stopped_by_a_signal_to_its_controller_reads_cancelled(tmp_path):
    """The local controller records a job it was told to end (SIGTERM to it, Ctrl-C to the
    launcher) as stopped with ``requeue: cancelled: not requeued``; the job id here is no
    live process, so the local backend gives FINISHED, which status replaces."""
    run_dir = tmp_path / "stopped"
    run_dir.mkdir()
    job = {"job_id": "999999999", "cluster": "local"}
    lines = [
        {"event": "submitted", **job, "time": 1.0},
        {"event": "started", **job, "attempt": 1, "host": "h", "time": 2.0},
        {"event": "stopped", **job, "exit": 75, "requeue": "cancelled: not requeued", "time": 3.0},
    ]
    (run_dir / "jobs.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    status = cqk(tmp_path / "state", "status", str(run_dir))
    assert re.search(r"job\s+999999999 \(local\): CANCELLED, attempt 1", status.stdout), (
        status.stdout
    )


def test_status_and_cancel_of_a_run_that_is_not_there_say_so_and_exit_2(tmp_path):
    """A mistyped name or path is the user's to fix: exit 2 (not 1, a failed cancel), one
    line on stderr saying where the launcher looked; the runs that are there are shown."""
    state, there = tmp_path / "state", tmp_path / "there"
    there.mkdir()
    for command in ("status", "cancel"):
        done = cqk(state, command, "nowhere", str(there))
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.startswith("error: nowhere: no such run folder, and no run of that")
        assert len(done.stderr.splitlines()) == 1, done.stderr
        assert str(there) in done.stdout, done.stdout
