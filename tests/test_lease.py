"""One job per run folder: the run lease (its holder, a dead holder's lease taken over, a
live one refused by name, a lost lease noticed), a plain ``cqk-train`` refused on a held
run before it builds a process group, and rendezvous ports (a single process picks a
free one; a port in use says how to set another)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:
    from cqk_megatron.run import lease as run_lease
except ImportError:  # the code before the lease: the tests below fail, not the module
    run_lease = None

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _write_holder(run_dir: Path, **fields) -> None:
    holder = run_lease.Holder.me()
    for key, value in fields.items():
        setattr(holder, key, value)
    run_dir.mkdir(parents=True, exist_ok=True)
    # written whole and renamed, as a contender writes it: the heartbeat thread of a lease
    # held in this process may read the file at any moment, and a truncated one reads as
    # an unreadable holder (seen once in CI)
    staged = run_dir / "lease.json.test-staged"
    staged.write_text(json.dumps(holder.__dict__))
    os.replace(staged, run_dir / "lease.json")


def test_a_held_run_is_refused_naming_the_holder_and_free_after_release(tmp_path):
    lease = run_lease.acquire(tmp_path / "run")
    try:
        recorded = json.loads((tmp_path / "run" / "lease.json").read_text())
        assert recorded["pid"] == os.getpid() and recorded["host"] == socket.gethostname()
        with pytest.raises(run_lease.LeaseHeld) as refused:
            run_lease.acquire(tmp_path / "run")
        message = str(refused.value)
        assert f"pid {os.getpid()}" in message and socket.gethostname() in message
        assert "cqk cancel" in message and "name=" in message
        lease.check()  # still ours
    finally:
        lease.release()
    assert not (tmp_path / "run" / "lease.json").exists()
    run_lease.acquire(tmp_path / "run").release()


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path, capsys):
    _write_holder(tmp_path, pid=_dead_pid(), job_id="4242")
    lease = run_lease.acquire(tmp_path)
    try:
        assert "took over the lease" in capsys.readouterr().err
        assert json.loads((tmp_path / "lease.json").read_text())["pid"] == os.getpid()
    finally:
        lease.release()


def test_a_reused_pid_does_not_keep_a_lease_alive(tmp_path):
    # the pid lives (it is ours) but started at another time: another process now
    _write_holder(tmp_path, pid_start="1")
    lease = run_lease.acquire(tmp_path)
    lease.release()


def test_another_hosts_holder_counts_as_alive_until_its_heartbeat_is_old(tmp_path, monkeypatch):
    monkeypatch.setenv("CQK_LEASE_TTL_S", "60")
    _write_holder(tmp_path, host="node-elsewhere", pid=1, heartbeat=time.time() - 10)
    with pytest.raises(run_lease.LeaseHeld, match="host node-elsewhere"):
        run_lease.acquire(tmp_path)
    _write_holder(tmp_path, host="node-elsewhere", pid=1, heartbeat=time.time() - 120)
    run_lease.acquire(tmp_path).release()


def test_an_unreadable_lease_is_taken_over(tmp_path):
    (tmp_path / "lease.json").write_text("{not json")
    run_lease.acquire(tmp_path).release()


def test_a_takeover_in_progress_is_not_raced(tmp_path):
    _write_holder(tmp_path, pid=_dead_pid())
    (tmp_path / "lease.json.takeover").touch()  # another contender is replacing it
    with pytest.raises(run_lease.LeaseHeld):
        run_lease.acquire(tmp_path)
    os.utime(tmp_path / "lease.json.takeover", (0, 0))  # that contender died long ago
    run_lease.acquire(tmp_path).release()


def test_the_heartbeat_renews_and_a_taken_lease_is_noticed(tmp_path, monkeypatch):
    monkeypatch.setenv("CQK_LEASE_HEARTBEAT_S", "0.2")
    lease = run_lease.acquire(tmp_path)
    try:
        first = json.loads((tmp_path / "lease.json").read_text())["heartbeat"]
        time.sleep(0.8)
        assert json.loads((tmp_path / "lease.json").read_text())["heartbeat"] > first
        _write_holder(tmp_path, host="node-elsewhere", pid=1)  # judged dead, taken
        deadline = time.monotonic() + 10
        while lease.lost_to is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lease.lost_to is not None and lease.lost_to.host == "node-elsewhere"
        with pytest.raises(run_lease.LeaseLost, match="node-elsewhere"):
            lease.check()
    finally:
        lease.release()
    assert (tmp_path / "lease.json").exists()  # the new holder's: not ours to remove


def test_a_plain_cqk_train_on_a_held_run_is_refused_before_it_starts(tmp_path):
    root = tmp_path / "runs"
    lease = run_lease.acquire(root / "busy")
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "cqk_megatron.train",
                "data.mock=true",
                "name=busy",
                f"log.root={root}",
                "log.wandb_mode=disabled",
                "train.train_steps=2",
            ],
            env={k: v for k, v in ENV.items() if k != "MASTER_PORT"},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        lease.release()
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"run folder {root / 'busy'} is in use by another job" in out.stderr
    assert f"pid {os.getpid()}" in out.stderr
    assert "Traceback" not in out.stderr
    assert sorted(p.name for p in (root / "busy").iterdir()) == []  # nothing written


def test_a_single_process_picks_a_free_port_and_a_busy_one_says_how_to_set_another():
    from cqk_megatron.parallel.process_groups import discover

    ports = {discover({}).master_port for _ in range(5)}
    assert all(20000 <= port < 32000 for port in ports) and len(ports) > 1
    assert discover({"MASTER_PORT": "23456"}).master_port == 23456
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = (
            "from cqk_megatron.parallel.process_groups import init_process_group, discover\n"
            f"init_process_group(discover({{'MASTER_PORT': '{port}'}}))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300
        )
    assert out.returncode != 0
    assert f"rendezvous port {port} on 127.0.0.1 is already in use" in out.stderr
    assert "set MASTER_PORT to a free port" in out.stderr
