"""The run contract (``cqk_megatron.run.folder`` and the one-concern modules beside it).

- a finished, a partial and a failed run folder, written the way training and the
  launcher write them (through the contract's writers: ``write_config``,
  ``MetricsLogger``, ``append_event``, ``launch.attempts.record_failure``), are classified
  the same way by ``launch status``, the launcher, repro and analysis ingest;
- an atomic write gives the file the umask's mode and is never seen half-written (HF
  exports' weights: ``tests/test_convert.py``, which has torch loaded already);
- no module outside the contract defines its names, codes or port rule again, and no
  module hand-rolls a temporary-and-rename write (a static check of the source).

Pure Python and fast: no training, no process group.
"""

from __future__ import annotations

import ast
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cqk_megatron.config import RunConfig, from_dict
from cqk_megatron.errors import EXIT_REQUEUE
from cqk_megatron.run.atomic import atomic_path, write_text_atomically
from cqk_megatron.run.folder import (
    CHECKPOINTS,
    FAULTS,
    METRICS,
    append_event,
    run_status,
    write_config,
)
from cqk_megatron.training.metrics import MetricsLogger
from launch.status import describe

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4


def _config(root: Path, name: str, steps: int = STEPS) -> RunConfig:
    return from_dict(
        RunConfig,
        {
            "name": name,
            "log": {"root": str(root), "wandb_mode": "disabled", "progress_bar": "off"},
            "train": {"train_steps": steps},
        },
        source="test",
    )


def _train(run_dir: Path, config: RunConfig, last_step: int, summary: bool) -> None:
    """What the training loop writes: the config, train/valid records, a checkpoint
    folder, and the summary when it finished."""
    write_config(run_dir, config)
    logger = MetricsLogger(run_dir, config, enabled=True)
    logger.set_start(0)
    for step in range(1, last_step + 1):
        logger.log(
            {
                "kind": "train",
                "step": step,
                "tokens": 64 * step,
                "loss": 5.0 - 0.1 * step,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "tokens_per_s": 100.0,
            }
        )
    logger.log(
        {
            "kind": "valid",
            "step": last_step,
            "tokens": 64 * last_step,
            "val_loss": 4.5,
            "val_ppl": 90.0,
        }
    )
    if summary:
        logger.log(
            {
                "kind": "summary",
                "steps": last_step,
                "tokens": 64 * last_step,
                "params_total": 1000,
                "params_non_embedding": 600,
                "flops_per_token": 6e3,
            }
        )
    logger.close()
    (run_dir / CHECKPOINTS / f"iter_{last_step:07d}").mkdir(parents=True)


def _job(run_dir: Path, job_id: str = "job-7") -> None:
    append_event(run_dir, "submitted", job_id=job_id, cluster="local")
    append_event(run_dir, "started", job_id=job_id, cluster="local", attempt=1)


@pytest.fixture
def folders(tmp_path) -> dict[str, Path]:
    """One run folder per case, keyed by the state it must be classified as."""
    from launch.attempts import Policy, record_failure

    made: dict[str, Path] = {}

    def folder(key: str, last_step: int, summary: bool) -> tuple[Path, float]:
        config = _config(tmp_path, key)
        run_dir = tmp_path / key
        since = time.time() - 1
        _job(run_dir)
        _train(run_dir, config, last_step, summary)
        made[key] = run_dir
        return run_dir, since

    run_dir, _ = folder("finished", STEPS, summary=True)
    append_event(run_dir, "finished", job_id="job-7", exit=0)
    # stopped to requeue (a signal, the time budget) after its checkpoint at step 2
    run_dir, _ = folder("partial", 2, summary=False)
    append_event(run_dir, "stopped", job_id="job-7", exit=EXIT_REQUEUE, requeue="requeued")
    # rank 1 killed at step 2, and the restart budget spent: the launcher stops the run
    run_dir, since = folder("failed", 2, summary=False)
    record_failure(run_dir, "job-7", 1, {0: 0, 1: -9}, 1, since, Policy(max_restarts=0))
    # the same failure with restarts left: relaunched, so it goes on (partial)
    run_dir, since = folder("relaunched", 2, summary=False)
    record_failure(run_dir, "job-7", 1, {0: 0, 1: -9}, 1, since, Policy(max_restarts=3))
    # a plain cqk-train (no launcher): a crash record after its last metrics record
    config = _config(tmp_path, "crashed")
    run_dir = tmp_path / "crashed"
    _train(run_dir, config, 2, summary=False)
    time.sleep(0.01)  # the crash comes after the last record the process logged
    crash = {"event": "crashed", "rank": 0, "step": 3, "error": "ValueError: boom"}
    with (run_dir / FAULTS).open("a") as handle:
        handle.write(json.dumps({**crash, "time": time.time()}) + "\n")
    made["crashed"] = run_dir
    return made


EXPECTED = {
    "finished": "finished",
    "partial": "partial",
    "failed": "failed",
    "relaunched": "partial",
    "crashed": "failed",
}


def _launch_status(run_dir: Path) -> str:
    """What ``submit.py status`` says of the run."""
    line = next(x for x in describe(run_dir).splitlines() if x.startswith("finished   "))
    if line.startswith("finished   yes"):
        return "finished"
    return "failed" if "failed" in line else line.split("(")[-1].rstrip(")")


def _repro_status(run_dir: Path) -> str:
    from cqk_megatron.repro.configs import ReproRun
    from cqk_megatron.repro.runner import status

    config = _config(run_dir.parent, run_dir.name)
    return status(ReproRun(run_dir.name, "standard", 0, config))


def test_launch_repro_and_analysis_classify_a_run_the_same_way(folders):
    from cqk_megatron.analysis.ingest import read_run_dir
    from launch import run_dir as runs

    for key, run_dir in folders.items():
        expected = EXPECTED[key]
        assert run_status(run_dir).state == expected, key
        assert _launch_status(run_dir) == expected, key
        assert runs.is_finished(run_dir, STEPS) == (expected == "finished"), key
        # repro skips exactly the finished runs; the others resume from their checkpoint
        assert _repro_status(run_dir) == ("done" if expected == "finished" else "resume"), key
        record = read_run_dir(run_dir)
        assert (record.state, record.finished) == (expected, expected == "finished"), key
    failed = run_status(folders["failed"])
    assert "max_restarts=0" in failed.why
    assert f"finished   no: failed ({failed.why})" in describe(folders["failed"])
    assert run_status(folders["crashed"]).why == "rank 0 crashed at step 3: ValueError: boom"


def test_finished_is_for_the_steps_asked_and_later_steps_undo_a_summary(tmp_path, folders):
    run_dir = folders["finished"]
    assert run_status(run_dir, STEPS).state == "finished"
    # train.train_steps raised since: not finished; it was started, so partial
    assert run_status(run_dir, STEPS + 4).state == "partial"
    # continued past its summary (steps logged after it): that summary is stale
    with (run_dir / METRICS).open("a") as handle:
        handle.write(json.dumps({"kind": "train", "step": STEPS + 1, "loss": 1.0}) + "\n")
    assert run_status(run_dir).state == "partial"
    # a folder with a config and a submission only: nothing started
    fresh = tmp_path / "fresh"
    write_config(fresh, _config(tmp_path, "fresh"))
    append_event(fresh, "submitted", job_id="job-9", cluster="local")
    assert run_status(fresh).state == "new"
    # a relaunched job that fails for good after a new start: failed; then resubmitted
    # by hand: it goes on again
    folder = folders["relaunched"]
    append_event(folder, "started", job_id="job-7", attempt=2)
    append_event(folder, "failed", job_id="job-7", reason="could not save a checkpoint")
    assert run_status(folder).state == "failed"
    assert run_status(folder).why == "could not save a checkpoint"
    append_event(folder, "submitted", job_id="job-8", cluster="local")
    assert run_status(folder).state == "partial"
    # a refusal is the job's, not the run's (another live job may hold the folder)
    append_event(folder, "refused", job_id="job-8", reason="run folder is in use")
    assert run_status(folder).state == "partial"
    # ... and under the launcher its failed record says stop (exit 2): failed, until the
    # job that holds the folder logs again
    append_event(
        folder,
        "failed",
        job_id="job-8",
        cause={"exit": 2},
        decision="stop",
        why="refused before training",
    )
    assert run_status(folder).state == "failed"
    time.sleep(0.01)
    logger = MetricsLogger(folder, _config(tmp_path, "relaunched"), enabled=True)
    logger.log(
        {"kind": "train", "step": 3, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0}
    )
    logger.close()
    assert run_status(folder).state == "partial"
    # a crashed plain run that was resumed and logged again is partial again
    crashed = folders["crashed"]
    assert run_status(crashed).state == "failed"
    time.sleep(0.01)
    logger = MetricsLogger(crashed, _config(tmp_path, "crashed"), enabled=True)
    logger.set_start(2)  # resumed from its checkpoint at step 2
    logger.log(
        {"kind": "train", "step": 3, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0}
    )
    logger.close()
    assert run_status(crashed).state == "partial"


def test_a_twin_refused_while_another_job_holds_the_run_is_not_the_runs_failure(
    tmp_path, folders, monkeypatch
):
    """Just after a twin submission was refused (exit 2, decision stop) and before the job
    that holds the run logs its next step, status said "finished no: failed"; the run
    trains on under that job. Once nobody holds the run, the refusal is its last word."""
    from cqk_megatron.run import lease as run_lease

    folder = folders["partial"]  # job-7 trained 2 steps and goes on
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "job-7")
    lease = run_lease.acquire(folder)  # this process stands for job-7's live rank 0
    try:
        _job(folder, "job-8")
        held = f"run folder {folder} is in use by another job ({lease.holder.describe()})"
        append_event(folder, "refused", job_id="job-8", reason=held)
        append_event(
            folder,
            "failed",
            job_id="job-8",
            cause={"rank": 0, "exit": 2},
            decision="stop",
            why="refused before training",
        )
        assert run_status(folder).state == "partial"
        assert "finished   no (partial)" in describe(folder)
    finally:
        lease.release()
    assert run_status(folder).state == "failed"  # job-7 is gone without logging again


# -- atomic writes ---------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_an_atomic_write_gets_the_mode_of_a_plain_open_under_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        plain = tmp_path / "plain.txt"
        plain.write_text("x")
        write_text_atomically(tmp_path / "a" / "config.yaml", "name: x\n")
        with atomic_path(tmp_path / "table.csv") as temporary:
            temporary.write_text("a,b\n")
        write_config(tmp_path / "run", _config(tmp_path, "run"))
    finally:
        os.umask(previous)
    expected = 0o666 & ~umask
    assert stat.S_IMODE(plain.stat().st_mode) == expected
    for path in (
        tmp_path / "a" / "config.yaml",
        tmp_path / "table.csv",
        tmp_path / "run" / "config.yaml",
    ):
        assert stat.S_IMODE(path.stat().st_mode) == expected, (path, oct(path.stat().st_mode))


def test_an_atomic_write_is_never_seen_half_written(tmp_path):
    """A reader polling the file while it is rewritten sees one whole version or the
    other, never a truncated or mixed one (a plain ``write_text`` fails this)."""
    path = tmp_path / "metrics.json"
    versions = ["a" * 2_000_000, "b" * 3_000_000]
    write_text_atomically(path, versions[0])
    seen: set[int] = set()
    bad: list[int] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            text = path.read_text()
            if text not in versions:
                bad.append(len(text))
            seen.add(len(text))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(40):
            write_text_atomically(path, versions[i % 2])
    finally:
        done.set()
        reader.join(timeout=60)
    assert not bad, f"read {len(bad)} partial versions, lengths {sorted(set(bad))[:5]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]  # no temporaries


def test_the_contract_imports_no_torch():
    code = (
        "import sys\n"
        "import cqk_megatron.run.folder, cqk_megatron.run.checkpoint_files\n"
        "import cqk_megatron.parallel.ports\n"
        "import cqk_megatron.errors, cqk_megatron.run.atomic\n"
        "import launch.run_dir, launch.status, cqk_megatron.repro.runner\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


# -- one home for each fact (static) ---------------------------------------------------

SOURCES = sorted(
    p for folder in ("cqk_megatron", "launch", "data_tools") for p in (ROOT / folder).rglob("*.py")
)
# Each name of the run folder, and the module that defines it.
NAMES = {
    "config.yaml": "cqk_megatron/run/folder.py",
    "metrics.jsonl": "cqk_megatron/run/folder.py",
    "history.jsonl": "cqk_megatron/run/folder.py",
    "jobs.jsonl": "cqk_megatron/run/folder.py",
    "faults.jsonl": "cqk_megatron/run/folder.py",
    "lease.json": "cqk_megatron/run/lease.py",  # the lease's own; run/folder.py imports it
    "checkpoints": "cqk_megatron/run/folder.py",
    "superseded": "cqk_megatron/run/folder.py",
    "submitit": "cqk_megatron/run/folder.py",
    "manifest.json": "cqk_megatron/run/checkpoint_files.py",
    "latest": "cqk_megatron/run/checkpoint_files.py",
}
# Same string, another file: the demo corpus's own record of what it built (no checkpoint).
OTHER_FILES = {
    ("manifest.json", "data_tools/demo_corpus.py"),
    ("checkpoints", "cqk_megatron/__main__.py"),  # a command's name: cqk bench checkpoints
}
RECORD_KINDS = {"train", "valid", "summary"}
# wandb's own record types (its run files), not our metrics records.
OTHER_KINDS = {("summary", "cqk_megatron/analysis/wandb_runs.py")}
# The contract's names that a module-level ``X = NAME`` would only alias.
ALIASED = {"MANIFEST", "LATEST", "FAULTS", "METRICS", "CONFIG", "JOBS", "LEASE", "EXIT_REQUEUE"}
# Functions of the contract and their one home.
HOMES = {
    "run_status": "cqk_megatron/run/folder.py",
    "read_metrics": "cqk_megatron/run/folder.py",
    "read_jsonl": "cqk_megatron/run/folder.py",
    "append_event": "cqk_megatron/run/folder.py",
    "summary_record": "cqk_megatron/run/folder.py",
    "latest_name": "cqk_megatron/run/checkpoint_files.py",
    "rendezvous_port": "cqk_megatron/parallel/ports.py",
    "free_port": "cqk_megatron/parallel/ports.py",
}
# analysis keeps a reader of its own on top of the contract's: it drops records that lack
# the fields its table needs (calling ``run_folder.read_metrics``).
OTHER_FUNCTIONS = {("read_metrics", "cqk_megatron/analysis/ingest.py")}
# Where a rename over a file stays, and why it is not an atomic write of one file:
RENAMES = {
    "cqk_megatron/run/atomic.py": "the one atomic writer",
    "cqk_megatron/run/folder.py": "supersede: moves files aside, writes nothing",
    "cqk_megatron/run/lease.py": "the lease's compare-and-swap: the temporary is checked "
    "under a mutex before it replaces the lease",
    "data_tools/outputs.py": "datasets streamed into partial files by builders, then "
    "committed bin, meta and idx in order",
    "cqk_megatron/training/checkpoint.py": "a checkpoint folder renamed into place",
    "cqk_megatron/convert/output_dir.py": "an export folder renamed into place",
}


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _module_assignments(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            yield node, names


def _ints(node: ast.AST) -> list[int]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and type(n.value) is int]


def _kind_compared(source: str, node: ast.Compare) -> str | None:
    """The record kind a ``... kind ... == "summary"`` comparison spells out, if any."""
    for right in node.comparators:
        if isinstance(right, ast.Constant) and right.value in RECORD_KINDS:
            if "kind" in (ast.get_source_segment(source, node.left) or ""):
                return right.value
    return None


def _violations() -> list[str]:
    out = []
    for path in SOURCES:
        where = _relative(path)
        source = path.read_text()
        tree = ast.parse(source)
        docs = _docstrings(tree)
        contract = where == "cqk_megatron/run/folder.py"
        for node, names in _module_assignments(tree):
            at = f"{where}:{node.lineno}"
            value = node.value
            if where != "cqk_megatron/errors.py":
                if any(n.startswith("EXIT_") for n in names):
                    out.append(f"{at}: {names} defined again (cqk_megatron/errors.py)")
                elif isinstance(value, ast.Constant) and value.value in (75, 76):
                    out.append(f"{at}: exit code {value.value} (cqk_megatron/errors.py)")
            parts = value.elts if isinstance(value, ast.Tuple) else [value]
            if all(isinstance(n, ast.Name) and n.id in ALIASED for n in parts):
                out.append(f"{at}: an alias of the contract's {ast.unparse(value)}")
            if where != "cqk_megatron/parallel/ports.py" and any(
                "PORT" in n.upper() for n in names
            ):
                if value is not None and any(i >= 1024 for i in _ints(value)):
                    out.append(f"{at}: a port range {names} (cqk_megatron/parallel/ports.py)")
        for node in ast.walk(tree):
            at = f"{where}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and id(node) not in docs:
                value = node.value
                if (
                    isinstance(value, str)
                    and value in NAMES
                    and NAMES[value] != where
                    and (value, where) not in OTHER_FILES
                ):
                    out.append(f"{at}: {value!r} (defined in {NAMES[value]})")
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
                if isinstance(node.right, ast.Constant) and node.right.value == 12000:
                    out.append(
                        f"{at}: the rendezvous-port rule again (cqk_megatron/parallel/ports.py)"
                    )
            elif isinstance(node, ast.FunctionDef) and node.name in HOMES:
                if where != HOMES[node.name] and (node.name, where) not in OTHER_FUNCTIONS:
                    out.append(f"{at}: def {node.name} again ({HOMES[node.name]})")
            elif isinstance(node, ast.Dict) and not contract:
                for key, value in zip(node.keys, node.values, strict=True):
                    if (
                        isinstance(key, ast.Constant)
                        and key.value == "kind"
                        and isinstance(value, ast.Constant)
                        and value.value in RECORD_KINDS
                    ):
                        out.append(f"{at}: record kind {value.value!r} spelled out")
            elif isinstance(node, ast.Compare) and not contract:
                kind = _kind_compared(source, node)
                if kind is not None and (kind, where) not in OTHER_KINDS:
                    out.append(f"{at}: record kind {kind!r} spelled out")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                func = node.func
                owner = func.value.id if isinstance(func.value, ast.Name) else ""
                renames = (owner == "os" and func.attr in ("replace", "rename")) or (
                    # Path.replace / Path.rename: one positional argument (str.replace takes 2)
                    func.attr in ("replace", "rename") and len(node.args) == 1 and not node.keywords
                )
                if renames and where not in RENAMES:
                    out.append(f"{at}: a hand-rolled rename (use cqk_megatron.run.atomic)")
                if func.attr == "mkstemp" and where != "cqk_megatron/run/atomic.py":
                    out.append(f"{at}: mkstemp makes 0600 files (use cqk_megatron.run.atomic)")
    return out


def test_no_module_outside_the_contract_defines_its_facts_again():
    violations = _violations()
    assert not violations, "\n".join(violations)


def test_the_static_check_finds_copies(tmp_path, monkeypatch):
    """The check above can fail: planted copies of each kind are found."""
    planted = tmp_path / "launch" / "copy.py"
    planted.parent.mkdir()
    planted.write_text(
        '"""A module with copies."""\n'
        "import os\n"
        'JOBS = "jobs.jsonl"\n'
        "EXIT_REQUEUE = 75\n"
        "REQUEUE = 75\n"
        "PORT_BASE = 20000\n"
        "MANIFEST_FILE, LATEST_FILE = MANIFEST, LATEST\n"
        "def is_done(records):\n"
        '    return any(r.get("kind") == "summary" for r in records)\n'
        "def write(path, text):\n"
        '    path.with_suffix(".tmp").write_text(text)\n'
        '    os.replace(path.with_suffix(".tmp"), path)\n'
        '    path.with_suffix(".tmp").replace(path)\n'
        "def rendezvous_port(job_id):\n"
        "    return 20000 + int(job_id) % 12000\n"
        "def stop():\n"
        "    EXIT_REQUEUE = 1\n"  # a local name: not a module's definition
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "SOURCES", [planted])
    found = "\n".join(_violations())
    for expected in (
        "'jobs.jsonl'",
        "['EXIT_REQUEUE'] defined again",
        "exit code 75",
        "launch/copy.py:5: exit code 75",
        "a port range ['PORT_BASE']",
        "an alias of the contract's (MANIFEST, LATEST)",
        "record kind 'summary'",
        "launch/copy.py:12: a hand-rolled rename",
        "launch/copy.py:13: a hand-rolled rename",
        "def rendezvous_port again",
        "launch/copy.py:15: the rendezvous-port rule again",
    ):
        assert expected in found, (expected, found)
    assert "launch/copy.py:17" not in found, found
