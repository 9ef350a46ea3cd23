"""Fault cases of a filesystem that refuses a run's writes (issue 39, 3), kept: a disk
that fills under an asynchronous save, a disk that fills between saves, a read-only run
folder. Each asserts the exit code (2: refused, so that no launcher relaunches into the
same disk), the one line (the path, the free space, the fix), no traceback, the record
files' last lines whole, no staging folder left, and nothing outside the run folder
changed.

The full disk is a small tmpfs, mounted here as root and unmounted after, as in
tests/test_full_disk.py (which keeps the 2-rank save through the launcher).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _tmpfs import mounted_tmpfs, remount_read_only
from test_fuzz import TIMEOUT_S, Watch, _ended

from cqk_megatron.errors import EXIT_REFUSED
from cqk_megatron.run import checkpoint_files

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
# a tiny_cpu checkpoint is about 2.8 MiB: a 4 MiB disk holds the first and not the second
SMALL_DISK = "4m"


@pytest.fixture
def disk(tmp_path):
    """A small tmpfs (root only), unmounted after; a file beside it shows that nothing
    outside the run folder changes."""
    with mounted_tmpfs(tmp_path / "disk", SMALL_DISK) as mount:
        yield mount


def _train(root: Path, *overrides: str, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cqk_megatron.train",
                "--config",
                str(REPO / "configs" / "runs" / "tiny_cpu.yaml"),
                f"log.root={root}",
                "name=full",
                "train.eval_interval=1000",
                *overrides,
            ],
            cwd=REPO,
            env=ENV,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _metrics_lines(run_dir: Path) -> list[dict]:
    """Every line of metrics.jsonl, each of which must be whole JSON."""
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n") or not text, text[-300:]
    return [json.loads(line) for line in text.splitlines()]


def _train_steps(run_dir: Path) -> int:
    try:
        return sum(r.get("kind") == "train" for r in _metrics_lines(run_dir))
    except (OSError, json.JSONDecodeError):
        return 0


def _error_line(text: str) -> str:
    assert "Traceback" not in text, text[-4000:]
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, text[-4000:]
    return errors[0]


def _no_staging(run_dir: Path) -> None:
    checkpoints = run_dir / "checkpoints"
    left = [p.name for p in checkpoints.iterdir()] if checkpoints.is_dir() else []
    assert not [name for name in left if name.endswith(".tmp")], left


def test_a_disk_full_under_an_asynchronous_save_is_refused_at_the_next_step(disk, tmp_path):
    """The background write of step 10 meets the full disk: its staging folder is removed
    at once, the next step boundary reports it (not the next metrics line: that was a
    chained traceback, exit 1, and iter_0000010.tmp kept the disk at 0 bytes free)."""
    watch = Watch(tmp_path)
    log = tmp_path / "train.log"
    steps = (
        "train.train_steps=15",
        "train.checkpoint.save_interval=5",
        "train.checkpoint.async_save=true",
    )
    code = _ended(_train(disk, *steps, log=log))
    text = log.read_text()
    assert code == EXIT_REFUSED, text[-4000:]
    run_dir = disk / "full"
    said = _error_line(text)
    assert "no space left on device writing checkpoint" in said, said
    assert str(run_dir / "checkpoints" / "iter_0000010") in said, said
    assert "free on the filesystem of" in said and "point log.root at a larger" in said, said
    assert "the previous checkpoint iter_0000005 is untouched" in said, said
    _no_staging(run_dir)
    assert checkpoint_files.latest_name(run_dir / "checkpoints") == "iter_0000005"
    steps_logged = [r["step"] for r in _metrics_lines(run_dir) if r.get("kind") == "train"]
    assert steps_logged == list(range(1, len(steps_logged) + 1)) and len(steps_logged) >= 10
    watch.assert_unchanged(lambda change: change.startswith("added disk/") or "train.log" in change)


def test_a_disk_that_fills_between_saves_is_refused_with_the_last_line_whole(disk, tmp_path):
    """The disk fills at step 7 of 40 (saves every 20): one line naming metrics.jsonl and
    the free space, exit 2 (68 lines of chained OSErrors, exit 1, and a truncated last
    line before)."""
    watch = Watch(tmp_path)
    log = tmp_path / "train.log"
    run_dir = disk / "full"
    process = _train(disk, "train.train_steps=40", "train.checkpoint.save_interval=20", log=log)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while _train_steps(run_dir) < 7 and process.poll() is None:
            assert time.monotonic() < deadline, "gave up waiting for step 7"
            time.sleep(0.1)
        _fill(disk / "filler")
    finally:
        code = _ended(process)
    text = log.read_text()
    assert code == EXIT_REFUSED, text[-4000:]
    said = _error_line(text)
    assert said.startswith(f"error: no space left on device writing {run_dir / 'metrics.jsonl'}")
    assert f"(0 B free on the filesystem of {disk})" in said, said
    assert said.endswith("free space there or point log.root at a larger filesystem"), said
    _metrics_lines(run_dir)  # every line whole
    assert not (run_dir / "lease.json").exists()
    watch.assert_unchanged(lambda change: change.startswith("added disk/") or "train.log" in change)


def _fill(path: Path) -> None:
    """Write ``path`` until the filesystem is full."""
    with path.open("wb") as out:
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        except OSError:
            pass
    try:
        with path.open("ab") as out:  # the last partial block
            while True:
                out.write(b"\0")
                out.flush()
    except OSError:
        pass


def test_a_record_line_is_appended_whole_or_not_at_all(tmp_path, monkeypatch):
    """A write that the disk cuts short part-way is taken back: the file ends with its
    last whole line, and the error says where, the free space and the fix."""
    import errno

    from cqk_megatron.run import atomic
    from cqk_megatron.run.folder import append_event, events
    from cqk_megatron.run.unwritable import NoSpaceError

    append_event(tmp_path, "started", step=0)
    before = (tmp_path / "jobs.jsonl").read_bytes()
    real_write = os.write
    calls = []

    def write_half_then_fill(descriptor, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(descriptor, data[: len(data) // 2])  # a short write
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "write", write_half_then_fill)
    with pytest.raises(NoSpaceError) as caught:
        append_event(tmp_path, "failed", step=7)
    monkeypatch.undo()
    assert len(calls) == 2
    assert (tmp_path / "jobs.jsonl").read_bytes() == before
    assert [e["event"] for e in events(tmp_path)] == ["started"]
    said = str(caught.value)
    assert said.startswith(f"no space left on device writing {tmp_path / 'jobs.jsonl'} (")
    assert "free on the filesystem of" in said and "point log.root at a larger" in said


# -- a read-only log.root or run folder ------------------------------------------------------

READ_ONLY_FIX = "point log.root at a writable folder"
TRAIN = [sys.executable, "-m", "cqk_megatron", "train"]
SUBMIT = [sys.executable, "-m", "cqk_megatron", "submit", "--cluster", "local", "--tasks", "1"]


def _refused(command: list[str], root: Path, *options: str) -> str:
    """``command`` on the tiny run under ``root``, refused (exit 2) before it trains: its
    one error line."""
    config = str(REPO / "configs" / "runs" / "tiny_cpu.yaml")
    out = subprocess.run(
        [*command, *options, "--config", config, f"log.root={root}", "name=ro"],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    text = f"{out.stdout}\n{out.stderr}"
    assert out.returncode == EXIT_REFUSED, text[-4000:]
    return _error_line(text)


@pytest.mark.parametrize(
    ("command", "options"),
    [(TRAIN, ()), (SUBMIT, ()), (TRAIN, ("--skip-preflight",))],
    ids=["cqk train", "cqk submit", "cqk train --skip-preflight"],
)
def test_a_read_only_log_root_is_refused_as_a_full_disk_is(command, options, tmp_path):
    """Refused by the pre-flight (or, without it, at the lease: the run's first write)
    with the line a full disk gets: the folder, the free space and the fix (a bare
    ``[Errno 30] Read-only file system``, exit 1 for the launcher, before)."""
    (tmp_path / "ro").mkdir()  # the mount point
    watch = Watch(tmp_path)
    with mounted_tmpfs(tmp_path / "ro", SMALL_DISK, read_only=True) as root:
        said = _refused(command, root, *options)
    where = root / "ro" / ("lease.json" if options else "")
    assert f"read-only filesystem writing {str(where).rstrip('/')} (" in said, said
    assert f"free on the filesystem of {root}); {READ_ONLY_FIX}" in said, said
    watch.assert_unchanged()
    watch.assert_no_process_left()


def test_a_read_only_run_folder_is_refused_as_a_full_disk_is(tmp_path):
    """A run folder whose filesystem turned read-only (what it holds stays as it was)."""
    with mounted_tmpfs(tmp_path / "disk", SMALL_DISK) as root:
        (root / "ro").mkdir()
        (root / "ro" / "notes.txt").write_text("kept\n")
        remount_read_only(root)
        watch = Watch(tmp_path)
        said = _refused(TRAIN, root)
        watch.assert_unchanged()
    assert f"read-only filesystem writing {root / 'ro'} (" in said, said
    assert f"free on the filesystem of {root}); {READ_ONLY_FIX}" in said, said
