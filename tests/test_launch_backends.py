"""Launch backends behind one protocol (``launch/backends/``).

- No code outside ``launch/backends/`` compares a backend's name: the launcher asks the
  backend object instead (an AST scan of ``launch/`` and ``cqk_megatron/``).
- ``--cluster`` with a name nobody registered is refused once, listing the known names.
- A toy backend registered from this file alone (no package file knows it) runs a tiny
  job through ``submit``, ``status`` and ``cancel``: it wraps the ``local`` backend with
  differences that each side of the launcher can only get from the toy (its name in the
  records, a rendezvous address the job's task asks it for, jobs the launcher does not
  wait for, and a cancel it records).
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

from cqk_megatron.config import ConfigError
from launch import submit
from launch.backends import Backend, backend_names, get_backend, register_backend

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300  # a shared 2-core machine; nothing here asserts on time
BACKEND_NAMES = {"slurm", "local"}


# -- nothing outside the backends compares a backend's name -----------------------------------


def _names_in(node: ast.AST) -> set[str]:
    """Backend names that ``node`` spells as a string (or a tuple/list/set of them)."""
    if isinstance(node, ast.Constant) and node.value in BACKEND_NAMES:
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_names_in(item) for item in node.elts))
    return set()


def _is_layer_implementation(node: ast.AST) -> bool:
    # ``config.transformer_impl`` is the run config's layer implementations
    # (Megatron-Core's "local" layers or Transformer Engine), not where a job runs.
    return isinstance(node, ast.Attribute) and node.attr == "transformer_impl"


def name_comparisons(path: Path) -> list[str]:
    """``file:line: code`` for each comparison (``==``, ``!=``, ``in``, ``match``) of a
    value with a backend's name in ``path``."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        names = set()
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if not any(_is_layer_implementation(operand) for operand in operands):
                names = set().union(*map(_names_in, operands))
        elif isinstance(node, ast.MatchValue):
            names = _names_in(node.value)
        if names:
            where = path.relative_to(REPO) if REPO in path.parents else path
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_code_outside_the_backends_compares_a_backend_name(tmp_path):
    backends = REPO / "launch" / "backends"
    files = [
        path
        for folder in ("launch", "cqk_megatron")
        for path in sorted((REPO / folder).rglob("*.py"))
        if backends not in path.parents
    ]
    found = [line for path in files for line in name_comparisons(path)]
    assert not found, "ask the launch backend instead:\n" + "\n".join(found)
    # and the scan sees what it looks for
    sample = tmp_path / "probe.py"
    sample.write_text('if cluster == "local" or kind in ("x", "slurm"):\n    pass\n')
    assert len(name_comparisons(sample)) == 2


def test_an_unknown_cluster_is_refused_naming_the_known_backends(capsys):
    config = str(REPO / "configs" / "runs" / "tiny_cpu.yaml")
    assert submit.main(["--config", config, "--cluster", "lsf", "--dry-run"]) == 2
    error = capsys.readouterr().err
    assert "--cluster 'lsf' is not a launch backend; known: slurm, local" in error
    assert "launch.backends.register_backend" in error
    with pytest.raises(ConfigError, match="known: slurm, local"):
        get_backend("pbs")
    with pytest.raises(TypeError, match="not a launch.backends.Backend subclass"):
        register_backend("pbs", object)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("local", ToyBackend)


# -- a toy backend, from this file alone ------------------------------------------------------


class ToyBackend(Backend):
    """The ``local`` backend with four differences the test can see: the records name
    ``toy``; each task is told to meet rank 0 at ``localhost`` (local: 127.0.0.1); the
    launcher does not wait for its jobs unless told to (local: it waits); each cancel is
    recorded in ``CANCELLED``."""

    launcher_owns_jobs = False
    job_arrays = False
    CANCELLED: list[str] = []  # job ids, in the launcher's process

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.local = get_backend("local")

    def check_resources(self, resources) -> None:
        self.local.check_resources(resources)

    def executor(self, folder, profile, resources, job_name, run_dir):
        return self.local.executor(folder, profile, resources, job_name, run_dir)

    def dry_run(self, groups, profile, array) -> list[str]:
        return [f"==> toy: {len(groups)} job(s) as processes on this machine"]

    def master_port(self) -> int | None:
        return self.local.master_port()

    def job_state(self, job_id: str) -> str:
        return self.local.job_state(job_id)

    def cancel(self, job_id: str) -> str:
        ToyBackend.CANCELLED.append(job_id)
        return "toy cancel: " + self.local.cancel(job_id)

    def rendezvous_address(self, env) -> str:
        return "localhost"

    def requeue(self, env) -> tuple[str, int]:
        return self.local.requeue(env)


register_backend("toy", ToyBackend)


@pytest.fixture
def toy_travels_with_the_job():
    """The job's tasks unpickle the backend with the job: this module is not importable
    there (pytest put tests/ on this process's path only), so its classes go by value,
    as an installed plugin's would go by name."""
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    yield
    cloudpickle.unregister_pickle_by_value(module)


def _events(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "jobs.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == event]


def _train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r["step"] for r in map(json.loads, lines) if r.get("kind") == "train"]


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.25)


def test_a_toy_backend_runs_a_job_through_submit_status_and_cancel(
    tmp_path, capsys, monkeypatch, toy_travels_with_the_job
):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    assert "toy" in backend_names()
    run_dir = tmp_path / "toy-run"
    argv = [
        "--config",
        str(REPO / "configs" / "runs" / "tiny_cpu.yaml"),
        "--cluster",
        "toy",
        "--tasks",
        "1",
        f"log.root={tmp_path}",
        "name=toy-run",
        "train.train_steps=100000",
        "train.checkpoint.save_interval=100000",
        "train.checkpoint.hashes=false",
    ]
    assert submit.main([*argv, "--dry-run"]) == 0
    assert "==> toy: 1 job(s) as processes on this machine" in capsys.readouterr().out

    # submit: the launcher returns at once (the toy's jobs are not the launcher's to wait on)
    assert submit.main(argv) == 0
    said = capsys.readouterr().out
    job_id = re.search(r"submitted toy-run: job (\d+) \(toy\)", said).group(1)
    assert "waiting" not in said
    try:
        _wait_until(lambda: len(_train_steps(run_dir)) >= 2, "the first steps")
        (started,) = _events(run_dir, "started")
        assert started["cluster"] == "toy" and started["job_id"] == job_id
        assert started["rendezvous"]["MASTER_ADDR"] == "localhost"  # the task asked the toy

        # status: the job's state, asked of the toy
        assert submit.main(["status", str(run_dir)]) == 0
        report = capsys.readouterr().out
        assert f"job        {job_id} (toy): RUNNING, attempt 1" in report, report

        # cancel: through the toy; the run saves a checkpoint, stops and is freed
        assert submit.main(["cancel", str(run_dir)]) == 0
        said = capsys.readouterr().out
        assert ToyBackend.CANCELLED == [job_id]
        assert f"cancelled (toy cancel: SIGTERM to local job {job_id}); the run is free" in said
    finally:
        if get_backend("toy").job_state(job_id) == "RUNNING":
            os.killpg(int(job_id), 9)
    (stopped,) = _events(run_dir, "stopped")
    assert stopped["requeue"] == "cancelled: not requeued"
    last = _train_steps(run_dir)[-1]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"iter_{last:07d}"
    assert submit.main(["status", str(run_dir)]) == 0
    report = capsys.readouterr().out
    assert f"job        {job_id} (toy): CANCELLED" in report  # ended by cancel
    assert re.search(rf"cancelled\s+job {job_id}: toy cancel", report), report


def test_a_second_ctrl_c_gives_the_caller_its_ctrl_c_back(capsys):
    """``stop_jobs_at_once`` ignores a third Ctrl-C while it cancels, then restores the
    handler it found: the launcher called from Python leaves its caller's Ctrl-C working.
    (No job to cancel: what is checked is the handler, around the real function.)"""
    import signal

    def callers_handler(signum, frame):  # pragma: no cover - never called
        raise AssertionError

    previous = signal.signal(signal.SIGINT, callers_handler)
    try:
        assert submit.stop_jobs_at_once(get_backend("local"), [], 130) == 130
        assert signal.getsignal(signal.SIGINT) is callers_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "interrupted again: stopping the local jobs at once" in capsys.readouterr().out
