"""A rank that dies or hangs never stalls a job: every case injects a real fault into a
real 2-rank training job (gloo on 127.0.0.1) and checks how long detection took, what was
printed and how the job ended. Each job has a bound; past it its processes are killed and
the test fails.

- Plain ranks (no launcher, so nothing but the watchdog ends them), all at once: a killed
  rank 0 (the store's host), a deadlocked main thread, and a rank that never reaches
  rendezvous (both ways round).
- Through ``launch/submit.py --cluster local``: one run that is hit by four faults in turn
  (kill -9 of rank 0 mid-step, SIGSTOP of rank 1 mid-step and of rank 0 mid-save, kill -9
  of rank 1 while its checkpoint shard is being written), relaunches itself after each and
  ends with the weights of an uninterrupted run bit for bit; and a run that crashes the
  same way at the same step every time, which stops after two attempts instead of
  spending its restart budget. (kill -9 of a non-zero rank mid-step: on node2 in
  tests/test_multinode.py.) These jobs and the plain ones all run at once.
- cqk-torchrun: a preemption (SIGTERM to torchrun and its workers) ends with 75.

Measured numbers are printed as ``measured: ...`` lines (``pytest -s``); the fault
table of docs/faults.md comes from them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _faults import (
    FAST,
    LAUNCHED,
    REPO,
    SAVE_INTERVAL,
    STEPS,
    Ranks,
    events,
    fault_times,
    faults_records,
    kill_group,
    measured,
    reference_run,
    run_all,
    start_reference,
    steps_logged,
    watchdog_lines,
)

from cqk_megatron.errors import EXIT_REQUEUE, EXIT_WATCHDOG

HOST = socket.gethostname()
HEARTBEAT_TIMEOUT_S, STEP_TIMEOUT_S, RENDEZVOUS_S = 5.0, 15.0, 10.0
# Detection may take a few heartbeats past its timeout on a loaded 2-core machine.
SLACK_S = 10.0
BOUND_S = 600  # per group of concurrent jobs


# -- plain ranks: the watchdog alone ---------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tmp_path_factory, launched_jobs) -> dict[str, Ranks]:
    """Plain 2-rank jobs, all at once (and while the launcher's jobs run: the machine's
    two cores are shared out best when every job of this module runs together)."""
    root = tmp_path_factory.mktemp("plain")
    long = ["train.train_steps=2000"]
    # init_timeout_s bounds the collective timeout and the step bound (validate())
    short_start = [
        f"train.resilience.init_timeout_s={RENDEZVOUS_S}",
        "train.resilience.collective_timeout_s=8",
        "train.resilience.step_timeout_s=6",
    ]
    groups = {
        "host-killed": Ranks(root, "host-killed", overrides=long),
        "deadlock": Ranks(
            root,
            "deadlock",
            env={"CQK_FAULT": "rank=1,phase=step,step=12,action=hang"},
            overrides=long,
        ),
        # The missing rank is never started: to its peer, the same as a rank that died
        # before rendezvous (and it costs no start-up).
        "no-rank1": Ranks(root, "no-rank1", overrides=short_start, absent=(1,)),
        "no-rank0": Ranks(root, "no-rank0", overrides=short_start, absent=(0,)),
    }
    faulted_at: dict[str, float] = {}

    def signal_rank(rank: int, sig: int):
        def act(group: Ranks) -> None:
            faulted_at[group.name] = time.time()
            os.kill(group.processes[rank].pid, sig)

        return act

    def past_step(step: int):
        return lambda group: steps_logged(group.run_dir) >= step

    for group in groups.values():
        group.start()
    run_all(
        list(groups.values()),
        {
            "host-killed": (past_step(12), signal_rank(0, signal.SIGKILL)),
        },
        BOUND_S,
    )
    for name, at in faulted_at.items():
        groups[name].faulted_at = at
    return groups


def _one_line(text: str) -> str:
    lines = watchdog_lines(text)
    assert len(lines) == 1, f"expected one watchdog line, got {lines}\n{text[-3000:]}"
    return lines[0]


def test_a_killed_store_host_is_named_by_the_survivor(plain):
    group = plain["host-killed"]
    code, ended = group.ended[1]
    assert code == EXIT_WATCHDOG, group.text(1)[-3000:]
    detected = ended - group.faulted_at
    assert detected <= HEARTBEAT_TIMEOUT_S + SLACK_S
    line = _one_line(group.text(1))
    assert f"rank 0 on {HOST} (pid {group.processes[0].pid}, last heard at step" in line
    assert "hosts the job's store at 127.0.0.1:" in line
    measured(
        "kill -9 of rank 0 (the store's host) mid-step, plain ranks", detected_after_s=detected
    )


def test_a_deadlocked_main_thread_is_named_by_every_rank(plain):
    group = plain["deadlock"]
    fault_at = fault_times(group.text(1))[0]
    for rank in (0, 1):
        code, ended = group.ended[rank]
        assert code == EXIT_WATCHDOG, group.text(rank)[-3000:]
        line = _one_line(group.text(rank))
        assert f"rank 1 on {HOST} (pid {group.processes[1].pid}, last heard at step 12" in line
        assert "overran phase 'step'" in line and "bound 15 s" in line
        assert "faults.py" in line  # where its main thread was: not in a collective
        detected = ended - fault_at
        assert STEP_TIMEOUT_S <= detected <= STEP_TIMEOUT_S + SLACK_S
    measured("a deadlocked main thread (rank 1), plain ranks", detected_after_s=detected)


@pytest.mark.parametrize("missing", [1, 0])
def test_a_rank_that_never_arrives_ends_the_job_within_init_timeout(plain, missing):
    group = plain[f"no-rank{missing}"]
    other = 1 - missing
    assert missing not in group.processes
    code, _ = group.ended[other]
    assert code == EXIT_WATCHDOG, group.text(other)[-3000:]
    line = _one_line(group.text(other))
    waited = float(re.search(r"within (\d+(?:\.\d+)?) s", line).group(1))
    assert waited <= RENDEZVOUS_S + 1
    if missing == 1:
        assert "rank 1 never arrived at rendezvous 127.0.0.1:" in line and "1 of 2" in line
    else:
        assert "rank 0 never arrived" in line and "could not be reached" in line
    (record,) = faults_records(group.run_dir)
    assert record["event"] == "rendezvous" and record["by_rank"] == other
    measured(f"rank {missing} exits before rendezvous, plain ranks", detected_after_s=waited)


# -- through the launcher: relaunch -----------------------------------------------------------


SUBMIT = [*LAUNCHED, "--cluster", "local"]


def _faults_in_turn(run_dir: Path, marks: Path) -> str:
    shard = run_dir / "checkpoints" / "iter_{:07d}.tmp" / "model" / "*"
    return ";".join(
        [
            f"rank=0,phase=step,step=15,action=kill,delay_s=0.005,once={marks}/1",
            f"rank=1,phase=step,step=25,action=stop,delay_s=0.005,once={marks}/2",
            f"rank=0,phase=save,step=30,action=stop,when={str(shard).format(30)},once={marks}/3",
            f"rank=1,phase=save,step=40,action=kill,when={str(shard).format(40)},once={marks}/4",
        ]
    )


@pytest.fixture(scope="module")
def launched_jobs(tmp_path_factory) -> dict:
    """Started here, waited for by ``launched``: three runs through the local launcher,
    uninterrupted (shared with tests/test_multinode.py), hit by four faults in turn, and
    crashing at step 15 every time (one task: the relaunch policy needs no second)."""
    root = tmp_path_factory.mktemp("launched")
    (root / "marks").mkdir()
    base = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    start_reference(tmp_path_factory)
    jobs = {
        "faulted": (
            ["--tasks", "2", "--max-restarts", "5"],
            {"CQK_FAULT": _faults_in_turn(root / "faulted", root / "marks")},
        ),
        "crashing": (
            ["--tasks", "1", "--max-restarts", "3"],
            {"CQK_FAULT": "rank=0,phase=step,step=15,action=crash"},
        ),
    }
    processes = {
        name: subprocess.Popen(
            [*SUBMIT, *options, f"log.root={root}", f"name={name}"],
            cwd=REPO,
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for name, (options, env) in jobs.items()
    }
    try:
        yield {"root": root, "processes": processes}
    finally:
        for process in processes.values():
            if process.poll() is None:
                kill_group(process)
        for job in (root / name for name in jobs):  # the job's controller and tasks
            for started in events(job, "submitted"):
                try:
                    os.killpg(int(started["job_id"]), signal.SIGKILL)
                except (ProcessLookupError, PermissionError, ValueError):
                    pass


@pytest.fixture(scope="module")
def launched(tmp_path_factory, launched_jobs) -> dict:
    """The launched jobs' outcomes, once all have ended (bounded: killed past it)."""
    out = {"root": launched_jobs["root"], "reference": reference_run(tmp_path_factory)}
    deadline = time.monotonic() + 900
    for name, process in launched_jobs["processes"].items():
        try:
            stdout, stderr = process.communicate(timeout=max(1, deadline - time.monotonic()))
        finally:
            if process.poll() is None:
                kill_group(process)
        out[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return out


def _records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _final_weights(run_dir: Path) -> dict:
    path = run_dir / "checkpoints" / f"iter_{STEPS:07d}" / "engine" / "pp0" / "ds"
    return torch.load(path / "mp_rank_00_model_states.pt", weights_only=False)["module"]


def _task_logs(run_dir: Path) -> str:
    return "\n".join(
        p.read_text(errors="replace") for p in sorted(run_dir.glob("submitit/*_log.*"))
    )


def test_a_run_hit_by_four_faults_relaunches_itself_and_ends_like_an_uninterrupted_one(launched):
    """kill -9 of rank 0 mid-step, SIGSTOP of rank 1 mid-step, SIGSTOP of rank 0 mid-save,
    kill -9 of rank 1 while its checkpoint shard is written (a non-zero rank killed
    mid-step: tests/test_multinode.py, on node2)."""
    reference, run = launched["reference"], launched["root"] / "faulted"
    out = launched["faulted"]
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert "all runs finished" in out.stdout
    assert [e["attempt"] for e in events(run, "started")] == [1, 2, 3, 4, 5]
    failed = events(run, "failed")
    assert [f["decision"] for f in failed] == ["relaunch"] * 4
    causes = [f["cause"] for f in failed]
    # 1: rank 0 killed mid-step: the launcher saw the signal and ended rank 1 at once.
    assert (causes[0]["rank"], causes[0].get("signal")) == (0, 9)
    assert failed[0]["exits"]["0"] == -9 and failed[0]["ended_by_launcher"] == [1]
    # 2: rank 1 stopped mid-step: rank 0's watchdog named it, the launcher killed it.
    assert causes[1]["rank"] == 1 and "sent no heartbeat" in causes[1]["reason"]
    assert "stopped (SIGSTOP)" in causes[1]["reason"]  # the kernel's word, on this host
    assert causes[1]["pid"] and 11 <= causes[1]["step"] <= 25  # its last heartbeat's step
    assert causes[1]["detected_by"] == 0 and failed[1]["exits"]["0"] == EXIT_WATCHDOG
    # 3: rank 0 (the store's host) stopped mid-save: rank 1 named it.
    assert causes[2]["rank"] == 0 and "hosts the job's store" in causes[2]["reason"]
    # Its last heartbeat's: the save's own beat may not have left before the stop, and on
    # a fast machine ten tiny steps fit in one beat interval, so the last beat can be the
    # start-up's of this attempt (at its resume step, 20). Seen twice in CI.
    assert (causes[2]["phase"], causes[2]["step"]) == ("startup", 20) or (
        causes[2]["phase"] in ("step", "save") and 21 <= causes[2]["step"] <= 30
    ), causes[2]
    assert failed[2]["step_reached"] == 30  # stopped in the save after step 30
    # 4: rank 1 killed while its shard of iter_0000040 was being written.
    assert (causes[3]["rank"], causes[3].get("signal")) == (1, 9)
    # Each resumed from the newest complete checkpoint: a half-written one never counts.
    assert [f["checkpoint_step"] for f in failed] == [10, 20, 20, 30]
    assert all(0 <= f["work_lost_steps"] <= SAVE_INTERVAL for f in failed)
    logs = _task_logs(run)
    for step in (10, 20, 30):
        assert f"resumed from {run}/checkpoints/iter_{step:07d} at step {step} (exactly)" in logs
    assert logs.count(f"resumed from {run}/checkpoints/iter_0000020 at step 20") == 2
    assert "iter_0000040 at step 40" not in logs
    # The run is the uninterrupted one: every step's loss (each record, also the redone
    # ones), the final validation loss, the final weights, bit for bit.
    expected = {r["step"]: r["loss"] for r in _records(reference, "train")}
    assert sorted(expected) == list(range(1, STEPS + 1))
    for record in _records(run, "train"):
        assert record["loss"] == expected[record["step"]], record["step"]
    assert _records(run, "valid")[-1]["val_loss"] == _records(reference, "valid")[-1]["val_loss"]
    ours, theirs = _final_weights(run), _final_weights(reference)
    tensors = [k for k, v in theirs.items() if isinstance(v, torch.Tensor)]
    assert len(tensors) > 10
    for name in tensors:
        assert torch.equal(ours[name], theirs[name]), name
    # Detection: from the moment each fault acted to the attempt's failure record.
    acted = sorted(fault_times(logs))
    assert len(acted) == 4
    names = [
        "kill -9 of rank 0 mid-step",
        "SIGSTOP of rank 1 mid-step",
        "SIGSTOP of rank 0 mid-save",
        "kill -9 of rank 1 mid-checkpoint-write",
    ]
    starts = events(run, "started")[1:]
    for name, at, record, start in zip(names, acted, failed, starts, strict=True):
        detected = record["detected_at"] - at
        bound = HEARTBEAT_TIMEOUT_S + SLACK_S if "SIGSTOP" in name else SLACK_S
        assert 0 <= detected <= bound, (name, detected)
        measured(
            f"{name}, local launcher",
            detected_after_s=detected,
            relaunched_after_s=start["time"] - at,
            steps_redone=record["work_lost_steps"],
            outcome=f"relaunched from step {record['checkpoint_step']}",
        )
    # status tells each attempt's cause and the work lost.
    report = subprocess.run(
        [*SUBMIT[:2], "status", str(run)], capture_output=True, text=True, timeout=60
    ).stdout
    assert f"failures   4, {sum(f['work_lost_steps'] for f in failed)} steps redone" in report
    assert f"attempt 1: rank 0 on {HOST} killed by signal 9 (SIGKILL) after step" in report
    assert "; restarted from step 10 (" in report and "steps since the last checkpoint" in report
    assert f"finished   yes: {STEPS} steps" in report


def test_the_same_crash_every_attempt_stops_early_naming_the_step(launched):
    run, out = launched["root"] / "crashing", launched["crashing"]
    assert out.returncode == 1, f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    assert "not finished: crashing" in out.stderr
    failed = events(run, "failed")
    assert [f["decision"] for f in failed] == ["relaunch", "stop"]  # max_restarts was 3
    for record in failed:
        assert record["cause"]["rank"] == 0
        assert record["cause"]["reason"] == "crashed: InjectedFault: CQK_FAULT: injected crash"
        assert record["cause"]["step"] == 15 and record["checkpoint_step"] == 10
    assert "the last 2 attempts failed the same way" in failed[-1]["why"]
    assert "in phase step of step 15" in out.stderr  # the summary names the step
    # the run contract calls it failed, in the launcher's words (launch status says it)
    from cqk_megatron.run.folder import run_status

    status = run_status(run)
    assert (status.state, status.why) == ("failed", failed[-1]["why"])
    assert len(events(run, "started")) == 2
    measured(
        "the same crash at step 15 on every attempt, local launcher",
        attempts=len(failed),
        outcome="stopped after 2 attempts",
    )


# -- torchrun -------------------------------------------------------------------------------


def test_a_preempted_torchrun_job_exits_75(tmp_path):
    """SIGTERM to torchrun's process group after a first save (as Slurm signals a step):
    the worker saves and stops with 75; torchrun itself would end with 1. (One worker:
    how the codes of several combine is the same code path.)"""
    command = [
        sys.executable,
        "-m",
        "cqk_megatron",
        "torchrun",
        "--nproc-per-node",
        "1",
        "--master-port",
        str(_free_port()),
        "-m",
        "cqk_megatron.train",
        "--config",
        "configs/runs/tiny_cpu.yaml",
        f"log.root={tmp_path}",
        "name=preempted",
        "train.train_steps=2000",
        "train.checkpoint.save_interval=5",
        "train.checkpoint.hashes=false",
        *FAST,
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    run_dir = tmp_path / "preempted"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:
            if (run_dir / "checkpoints" / "latest").exists() and steps_logged(run_dir) >= 7:
                break
            time.sleep(0.2)
        os.killpg(process.pid, signal.SIGTERM)
        output = process.communicate(timeout=300)[0]
    finally:
        kill_group(process)
    assert process.returncode == EXIT_REQUEUE, output[-3000:]
    assert "cqk torchrun: exit 75 (workers: {0: 75})" in output
    assert "stopping at step" in output and "SIGTERM" in output


def _free_port() -> int:
    from _multiproc import free_port

    return free_port()


# -- no processes: the rules ------------------------------------------------------------------


def test_srun_lines_give_each_task_its_exit_and_node():
    from launch.attempts import srun_exits

    text = "\n".join(
        [
            "cqk-attempt: begins 0 on node1",
            "srun: error: node2: task 1: Killed",
            "srun: launch/slurm: _step_signal: Terminating StepId=5.0",
            "srun: error: node1: task 0: Exited with exit code 76",
            "srun: error: node3: tasks 2-3: Terminated",
        ]
    )
    exits, order, hosts = srun_exits(text)
    assert exits == {1: -9, 0: 76, 2: -15, 3: -15} and order == [1, 0, 2, 3]
    assert hosts == {1: "node2", 0: "node1", 2: "node3", 3: "node3"}


def test_the_rank_a_verdict_names_is_the_cause_whatever_its_giver_did_next(tmp_path):
    # node2 vanished: rank 0's watchdog named rank 1, then, while rank 0 was ending, Slurm
    # (node2 DOWN) killed its step, and its main thread raised too. srun saw only rank 0.
    from launch.attempts import find_cause

    verdict = {"event": "lost", "by_rank": 0, "ranks": [1], "host": "node2", "time": 100.0}
    verdict.update(step=15, phase="forward", reason="sent no heartbeat for 5.0 s")
    late_crash = {"event": "crashed", "rank": 0, "host": "node1", "time": 101.0}
    late_crash.update(step=15, phase="forward", error="RuntimeError: boom")
    (tmp_path / "faults.jsonl").write_text(
        "\n".join(json.dumps(r) for r in (verdict, late_crash)) + "\n"
    )
    for code in (-15, -9, 1, 76):
        cause = find_cause(tmp_path, {0: code}, 0, since=50.0, hosts={0: "node1"})
        assert (cause["rank"], cause["host"], cause["detected_by"]) == (1, "node2", 0), code
    # A rank that was itself killed first (not a verdict's giver) is still the cause.
    cause = find_cause(tmp_path, {1: -9, 0: 76}, 1, since=50.0, hosts={1: "node2"})
    assert (cause["rank"], cause["signal"]) == (1, 9)
    # A crash before any verdict stays the cause.
    (tmp_path / "faults.jsonl").write_text(json.dumps({**late_crash, "time": 99.0}) + "\n")
    assert find_cause(tmp_path, {0: 1}, 0, since=50.0)["reason"] == "crashed: RuntimeError: boom"


def test_a_failure_repeated_the_same_way_stops_and_the_budget_is_bounded():
    from launch.attempts import Policy, decide

    def failure(rank, signal_number, step, decision="relaunch"):
        return {
            "cause": {"rank": rank, "signal": signal_number},
            "step_reached": step,
            "decision": decision,
        }

    policy = Policy(max_restarts=3, max_identical_failures=2)
    assert decide([], failure(1, 9, 14), policy)[0] == "relaunch"
    decision, why = decide([failure(1, 9, 14)], failure(1, 9, 14), policy)
    assert decision == "stop" and "the last 2 attempts failed the same way" in why
    # a different step, rank or signal is another failure: relaunched, up to max_restarts
    assert decide([failure(1, 9, 14)], failure(1, 9, 24), policy)[0] == "relaunch"
    assert decide([failure(1, 9, 14)], failure(0, 9, 14), policy)[0] == "relaunch"
    three = [failure(1, 9, 4), failure(0, 9, 14), failure(1, 9, 24)]
    decision, why = decide(three, failure(0, 9, 34), policy)
    assert decision == "stop" and "relaunched 3 times already (max_restarts=3)" in why
    assert decide([], failure(1, 9, 14), Policy(0, 2)) == (
        "stop",
        "relaunched 0 times already (max_restarts=0)",
    )


def test_a_run_refused_before_training_is_not_relaunched():
    # exit 2 (EXIT_REFUSED: a held run folder, checkpoints that do not verify, bad data)
    # cannot change on a relaunch; exit 1 (a crash) can.
    from launch.attempts import Policy, decide

    def failure(code):
        return {"cause": {"rank": 0, "exit": code}, "step_reached": 0}

    decision, why = decide([], failure(2), Policy(max_restarts=3, max_identical_failures=2))
    assert decision == "stop" and "the run was refused (exit 2" in why
    assert decide([], failure(1), Policy(max_restarts=3, max_identical_failures=2))[0] == (
        "relaunch"
    )


def test_in_a_partition_the_side_that_reaches_the_store_names_the_lost_rank(tmp_path):
    # node2 cut off (CI, stop 22's second run): rank 1 there lost the store (rank 0's) and
    # named rank 0 first; rank 0, beside the store, heard rank 1's silence. Slurm requeued
    # the job itself (no exits).
    from launch.attempts import find_cause

    store = {"event": "lost", "by_rank": 1, "kind": "store", "ranks": [0], "host": "node1"}
    silent = {"event": "lost", "by_rank": 0, "kind": "silent", "ranks": [1], "host": "node2"}
    records = [{**store, "time": 100.0}, {**silent, "time": 100.0001}]
    (tmp_path / "faults.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for exits, first_bad in (({}, None), ({0: -9}, 0), ({1: 76, 0: 76}, 1)):
        cause = find_cause(tmp_path, exits, first_bad, since=50.0)
        assert (cause["rank"], cause["host"], cause["detected_by"]) == (1, "node2", 0), exits
    # The store's host really gone (no rank beside it to say otherwise): the store verdict.
    (tmp_path / "faults.jsonl").write_text(json.dumps({**store, "time": 100.0}) + "\n")
    assert find_cause(tmp_path, {}, None, since=50.0)["rank"] == 0


def test_refusals_are_one_list_that_a_failed_save_is_not_on():
    from cqk_megatron.config import ConfigError
    from cqk_megatron.data.errors import DataError
    from cqk_megatron.errors import is_refusal
    from cqk_megatron.run.checkpoint_files import CheckpointError, CheckpointSaveError
    from cqk_megatron.run.lease import LeaseHeld, LeaseLost
    from cqk_megatron.run.unwritable import NoSpaceError

    # a write the filesystem refuses (full, read-only, a name too long) refuses the run:
    # a relaunch would meet the same filesystem
    refused = (LeaseHeld("x"), CheckpointError("x"), DataError("x"), ConfigError("x"))
    for error in (*refused, NoSpaceError("x")):
        assert is_refusal(error), error
    for error in (CheckpointSaveError("x"), LeaseLost("x"), RuntimeError()):
        assert not is_refusal(error), error


def test_a_refusal_is_a_class_of_refusal_and_nothing_else():
    """One base class: a new refusal needs no edit of ``is_refusal``, which imports nothing."""
    import ast
    import inspect

    from cqk_megatron import errors as refusals
    from cqk_megatron.config import ConfigError
    from cqk_megatron.data.errors import DataError
    from cqk_megatron.planner.preflight import PreflightError
    from cqk_megatron.run.checkpoint_files import CheckpointError, CheckpointSaveError
    from cqk_megatron.run.lease import LeaseHeld

    for cls in (ConfigError, PreflightError, DataError, CheckpointError, LeaseHeld):
        assert issubclass(cls, refusals.Refusal), cls
    assert refusals.is_refusal(CheckpointSaveError("full", disk_full=True))

    class ToyRefusal(refusals.Refusal):
        pass

    assert refusals.is_refusal(ToyRefusal("x")) and not refusals.is_refusal(ValueError("x"))
    body = ast.parse(inspect.getsource(refusals.is_refusal))
    assert not [n for n in ast.walk(body) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_fault_drills_and_watchdog_bounds_are_checked():
    from cqk_megatron.config import ConfigError, load_config, validate
    from cqk_megatron.training.resilience import faults

    fault = faults.parse("rank=1,phase=save,step=50,action=kill,when=/x/*,once=/m")
    assert (fault.rank, fault.phase, fault.step, fault.action) == (1, "save", 50, "kill")
    assert fault.matches("save", 50, 1) and not fault.matches("save", 50, 0)
    for bad, message in [
        ("phase=step,action=explode", "action must be one of"),
        ("phase=nap,action=kill", "phase must be one of"),
        ("phase=step,action=kill,colour=red", "unknown keys ['colour']"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            faults.parse(bad)
    with pytest.raises(ConfigError) as error:
        validate(load_config(None, ["train.resilience.heartbeat_timeout_s=200"]))
    assert (
        "train.resilience.heartbeat_timeout_s=200.0 must be below "
        "train.resilience.collective_timeout_s" in str(error.value)
    )
    with pytest.raises(ConfigError, match="train.resilience.init_timeout_s=0.0 must be a positive"):
        validate(load_config(None, ["train.resilience.init_timeout_s=0"]))
    validate(load_config(None, FAST))


def _threads_by_name() -> dict[str, int]:
    """This process's threads by their kernel name, from /proc: C++ ones included (gloo's
    are ``pt_gloo_runloop``, the store server's ``pt_tcpstore_uv``); Python's own threads
    are all ``python`` there."""
    counts: dict[str, int] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue  # ended meanwhile
        counts[name] = counts.get(name, 0) + 1
    return counts


def test_watchdogs_leave_no_thread_or_store_client_behind():
    """A process that trains several runs (the tests' rank workers do) starts a watchdog
    per run: each must end its threads and its store connection when closed, and a
    heartbeat must not open a connection of its own. Two ranks' watchdogs in this
    process, on a real TCPStore, for three runs in a row."""
    from datetime import timedelta

    import torch.distributed as dist
    from _multiproc import free_port

    from cqk_megatron.training.resilience.watchdog import Bounds, Watchdog

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=10), wait_for_workers=False)
    bounds = Bounds(interval_s=0.05, heartbeat_timeout_s=2.0, init_s=10, step_s=5, save_s=10)

    def connections() -> int:  # established TCP connections to the store's port, both ends
        lines = [  # the store listens on IPv6 too (clients show as ::ffff:127.0.0.1)
            line
            for table in ("tcp", "tcp6")
            for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        ]
        ports = [int(part, 16) for line in lines for part in _tcp_ports(line)]
        return ports.count(port)

    baseline, baseline_connections = _threads_by_name(), connections()
    for generation in range(1, 4):
        dogs = [
            Watchdog(rank, 2, "127.0.0.1", port, bounds, generation=generation).start()
            for rank in (0, 1)
        ]
        for step in range(1, 4):
            for dog in dogs:
                dog.enter("data", step)
            time.sleep(0.3)  # about 6 heartbeats each
        names = sorted(t.name for t in threading.enumerate() if t.name.startswith("cqk-"))
        assert names == ["cqk-watchdog"] * 2 + ["cqk-watchdog-store"] * 2
        # one client per watchdog, whatever the number of heartbeats: 2 connections, 2 ends
        assert connections() - baseline_connections == 4
        for dog in reversed(dogs):  # rank 1 is done first; rank 0, the host, then sees it
            dog.close()
        deadline = time.monotonic() + 5
        while _threads_by_name() != baseline and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _threads_by_name() == baseline, f"after run {generation}"
        assert not [t.name for t in threading.enumerate() if t.name.startswith("cqk-")]
        assert connections() == baseline_connections, f"after run {generation}"
    del store


def _tcp_ports(line: str) -> list[str]:
    """An established /proc/net/tcp line's local and remote ports (hex); [] otherwise."""
    fields = line.split()
    if fields[3] != "01":  # TCP_ESTABLISHED
        return []
    return [fields[1].rsplit(":", 1)[1], fields[2].rsplit(":", 1)[1]]
