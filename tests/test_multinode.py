"""Training across two Slurm nodes on one machine, and what a lost node or task does.

The nodes are network namespaces with their own hostnames and addresses (node1, node2 on
198.18.<port % 256>.0/24; ``CQK_SLURM_NODES=2 scripts/slurm/start.sh``, torn down by
stop.sh), each running its own slurmd; slurmctld runs on the namespaces' bridge. Jobs
rendezvous at node1 by name and their gloo traffic crosses the namespaces' veths: nothing
leaves those addresses. The cluster is started here (and stopped at the end if this module
started it) with its own state folder and ports, beside the one-node cluster of
tests/test_launch.py.

- A 2 nodes x 1 task job whose task on node2 is killed at step 15: srun's
  ``--kill-on-bad-exit`` ends the step, the batch script records the attempt and requeues
  the job, which resumes and ends with the losses and weights of the same run on one node
  (the local launcher), bit for bit.
- node2 vanishing from the network mid-run (its link down: no TCP reset reaches node1):
  rank 0's watchdog names rank 1 within the heartbeat timeout, slurmctld declares the node
  DOWN and requeues the job, and once the link is back the job resumes and finishes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _faults import FAST, REPO, events, fault_times, faults_records, kill_group, measured
from _slurm_bed import skip_or_fail, slurm_problem

from cqk_megatron.errors import EXIT_REQUEUE, EXIT_WATCHDOG

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "ip", "unshare", "nsenter")
DIR = os.environ.get("CQK_SLURM_MULTINODE_DIR", "/tmp/cqk-slurm-2nodes")
CTLD_PORT = int(os.environ.get("CQK_SLURM_MULTINODE_CTLD_PORT", "6827"))
SLURMD_PORT = int(os.environ.get("CQK_SLURM_MULTINODE_SLURMD_PORT", "6828"))
BED = {
    "CQK_SLURM_DIR": DIR,
    "CQK_SLURM_CTLD_PORT": str(CTLD_PORT),
    "CQK_SLURM_SLURMD_PORT": str(SLURMD_PORT),
    "CQK_SLURM_NODES": "2",
}
STEPS, SAVE_INTERVAL = 40, 10
JOB_TIMEOUT_S = 600
HEARTBEAT_TIMEOUT_S, SLACK_S = 5.0, 10.0
COMMON = [
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
SUBMIT = [sys.executable, str(REPO / "launch" / "submit.py")]


def _run(command: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def two_nodes():
    """SLURM_CONF of the running two-node cluster (started here if it is not)."""
    problem = slurm_problem(TOOLS, root_reason="network namespaces and slurmd need root")
    if problem:
        skip_or_fail(problem)
    env = {**os.environ, **BED}
    out = _run(["bash", str(REPO / "scripts" / "slurm" / "start.sh")], env=env)
    assert out.returncode == 0, f"start.sh (2 nodes) failed:\n{out.stdout}\n{out.stderr}"
    conf = re.search(r"export SLURM_CONF=(\S+)", out.stdout).group(1)
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        _run(["scancel", "--user=root"], env={**os.environ, "SLURM_CONF": conf})
        if "started" in out.stderr:
            _run(["bash", str(REPO / "scripts" / "slurm" / "stop.sh")], env=env)
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("multinode")


@pytest.fixture(scope="module")
def one_node(root) -> subprocess.Popen:
    """The same run on one node (the local launcher, 2 tasks), started at once: the Slurm
    jobs run meanwhile, and compare with it when it is done."""
    return subprocess.Popen(
        [
            *SUBMIT,
            *COMMON,
            "--cluster",
            "local",
            "--tasks",
            "2",
            f"log.root={root}",
            "name=one-node",
        ],
        cwd=REPO,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _reference(root: Path, process: subprocess.Popen, name: str = "one-node") -> Path:
    try:
        output = process.communicate(timeout=JOB_TIMEOUT_S)[0]
    finally:
        if process.poll() is None:
            kill_group(process)
    assert process.returncode == 0, output[-3000:]
    return root / name


def _submit(root: Path, name: str, env: dict | None = None, *extra: str, tasks: int = 1) -> str:
    out = _run(
        [
            *SUBMIT,
            *COMMON,
            "--cluster",
            "slurm",
            "--nodes",
            "2",
            "--tasks",
            str(tasks),
            f"log.root={root}",
            f"name={name}",
            *extra,
        ],
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    return re.search(r"submitted \S+: job (\S+) \(", out.stdout).group(1)


def _state(job_id: str) -> str:
    out = _run(["scontrol", "show", "job", "--oneliner", job_id], timeout=30).stdout
    match = re.search(r"JobState=(\S+)", out)
    return match.group(1) if match else "UNKNOWN"


def _wait(condition, what: str, timeout: float = JOB_TIMEOUT_S, run_dir: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    detail = ""
    if run_dir is not None:
        detail = _run([*SUBMIT, "status", str(run_dir)], timeout=60).stdout
        for log in sorted(run_dir.glob("submitit/*_log.err")):
            detail += f"\n--- {log}\n" + "\n".join(
                log.read_text(errors="replace").splitlines()[-15:]
            )
    pytest.fail(f"gave up waiting for {what}\n{detail}")


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = [json.loads(x) for x in path.read_text().splitlines() if '"train"' in x]
    return max((r["step"] for r in lines), default=0)


def _assert_same_run(run_dir: Path, reference: Path, steps: int = STEPS) -> None:
    def records(folder: Path, kind: str) -> list[dict]:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["kind"] == kind]

    expected = {r["step"]: r["loss"] for r in records(reference, "train")}
    assert sorted(expected) == list(range(1, steps + 1))
    ours = records(run_dir, "train")
    assert {r["step"] for r in ours} == set(expected)
    for record in ours:
        assert record["loss"] == expected[record["step"]], record["step"]
    assert records(run_dir, "valid")[-1]["val_loss"] == records(reference, "valid")[-1]["val_loss"]

    def weights(folder: Path) -> dict:
        path = folder / "checkpoints" / f"iter_{steps:07d}" / "engine" / "pp0" / "ds"
        return torch.load(path / "mp_rank_00_model_states.pt", weights_only=False)["module"]

    a, b = weights(run_dir), weights(reference)
    tensors = [k for k, v in b.items() if isinstance(v, torch.Tensor)]
    assert len(tensors) > 10
    for name in tensors:
        assert torch.equal(a[name], b[name]), name


def _finished(run_dir: Path) -> bool:
    return bool(events(run_dir, "finished"))


def test_a_task_killed_on_node2_relaunches_the_job_which_ends_like_one_node(
    two_nodes, root, one_node
):
    run_dir = root / "killed-task"
    fault = f"rank=1,phase=step,step=15,action=kill,delay_s=0.005,once={root}/killed-task.once"
    job_id = _submit(root, "killed-task", {"CQK_FAULT": fault}, "--max-restarts", "2")
    _wait(lambda: _finished(run_dir), f"job {job_id} to finish", run_dir=run_dir)
    started = events(run_dir, "started")
    assert [e["attempt"] for e in started] == [1, 2]
    for start in started:  # rendezvous at node1 by name, one task on each node
        assert start["hosts"] == ["node1", "node2"] and start["host"] == "node1"
        assert start["rendezvous"]["MASTER_ADDR"] == "node1"
        assert start["slurm"]["SLURM_JOB_NODELIST"] == "node[1-2]"
    (failed,) = events(run_dir, "failed")
    cause = failed["cause"]
    assert (cause["rank"], cause["host"], cause.get("signal")) == (1, "node2", 9)
    assert failed["decision"] == "relaunch" and failed["checkpoint_step"] == 10
    assert 0 <= failed["work_lost_steps"] <= SAVE_INTERVAL
    log = "\n".join(p.read_text(errors="replace") for p in run_dir.glob("submitit/*_log.*"))
    assert "srun: error: node2: task 1: Killed" in log
    assert f"resumed from {run_dir}/checkpoints/iter_0000010 at step 10 (exactly)" in log
    report = _run([*SUBMIT, "status", str(run_dir)], timeout=60).stdout
    assert "attempt 1: rank 1 on node2 killed by signal 9 (SIGKILL) after step" in report
    assert "restarted from step 10" in report
    (acted,) = fault_times(log)
    measured(
        "kill -9 of rank 1 (on node2) mid-step, 2-node Slurm",
        detected_after_s=failed["time"] - acted,
        steps_redone=failed["work_lost_steps"],
        outcome="requeued, resumed from step 10",
    )
    _assert_same_run(run_dir, _reference(root, one_node))


def test_node2_vanishing_from_the_network_is_named_and_the_job_resumes_when_it_returns(
    two_nodes, root, one_node
):
    run_dir = root / "lost-node"
    job_id = _submit(root, "lost-node", None, "--max-restarts", "2")
    link = f"cqk{CTLD_PORT}n2"  # node2's veth on the bridge (scripts/slurm/nodes.sh)
    _wait(lambda: _steps(run_dir) >= 15, "step 15", run_dir=run_dir)
    cut = time.time()
    subprocess.run(["ip", "link", "set", link, "down"], check=True)
    try:
        _wait(
            lambda: any(r["event"] == "lost" for r in faults_records(run_dir)),
            "rank 0's watchdog verdict",
            timeout=HEARTBEAT_TIMEOUT_S + SLACK_S + 30,
        )
        _wait(
            lambda: _state(job_id) in ("PENDING", "REQUEUED", "NODE_FAIL", "COMPLETING"),
            "slurmctld to end the attempt",
            timeout=120,
            run_dir=run_dir,
        )
        ended = time.time()
        # As an operator would: hold the requeued job until node2 is back and clean. A
        # rejoining node may still hold the lost attempt's step of this job id, and
        # Slurm's order to end it would also end a new attempt's task there.
        _wait(
            lambda: _run(["scontrol", "hold", job_id], timeout=30).returncode == 0,
            f"job {job_id} to be held",
            timeout=60,
            run_dir=run_dir,
        )
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
    _wait(
        lambda: (
            _run(["sinfo", "-h", "-n", "node2", "-o", "%T"], timeout=30).stdout.strip() == "idle"
        ),
        "node2 to rejoin, idle",
        timeout=180,
        run_dir=run_dir,
    )
    time.sleep(5)  # the rejoined slurmd's stale-step cleanup
    assert _run(["scontrol", "release", job_id], timeout=30).returncode == 0
    _wait(lambda: _finished(run_dir), f"job {job_id} to finish", run_dir=run_dir)
    (lost,) = [r for r in faults_records(run_dir) if r["event"] == "lost" and r["by_rank"] == 0]
    assert lost["ranks"] == [1] and lost["host"] == "node2"
    assert "sent no heartbeat" in lost["reason"] and "unreachable" in lost["reason"]
    detected = lost["time"] - cut
    assert HEARTBEAT_TIMEOUT_S - 1 <= detected <= HEARTBEAT_TIMEOUT_S + SLACK_S
    starts = events(run_dir, "started")
    failed, *later = events(run_dir, "failed")  # by the batch script, or the next attempt
    assert failed["attempt"] == 1 and failed["decision"] == "relaunch"
    # Even held until node2 is idle, the rejoined node's stale-step cleanup may SIGTERM the
    # next attempt: it saves and requeues (exit 75), losing nothing.
    stops = events(run_dir, "stopped")
    assert all(stop["exit"] == EXIT_REQUEUE for stop in stops)
    assert not later and [e["attempt"] for e in starts] == list(range(1, 3 + len(stops)))
    assert (failed["cause"]["rank"], failed["cause"]["host"]) == (1, "node2"), (failed, lost)
    assert 0 <= failed["work_lost_steps"] <= SAVE_INTERVAL
    log = "\n".join(p.read_text(errors="replace") for p in run_dir.glob("submitit/*_log.*"))
    assert f"exits {EXIT_WATCHDOG}" in log
    measured(
        "node2 vanishes from the network mid-run, 2-node Slurm",
        detected_after_s=detected,
        attempt_ended_after_s=ended - cut,
        outcome="node DOWN, job requeued, resumed when the node returned",
    )
    _assert_same_run(run_dir, _reference(root, one_node))
