"""Nothing already written is lost: checkpoints that do not verify stop the run instead of
being trained over, retention keeps what the run needs, ``latest`` names a complete
folder, a crash and resume never logs a step twice, a full disk says so and leaves the
previous checkpoint whole, and a checkpoint of another shape is refused in config terms.

The training runs are the tiny model of ``tests/_training.py`` on synthetic data, in
spawned gloo ranks; the files are damaged between the spawns, as a bad disk or a killed
copy would. The full-disk test mounts a small tmpfs (as root) and unmounts it after.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _multiproc import free_port, run_ranks
from _tmpfs import mounted_tmpfs
from _training import FILL, attempts, folder_listing, train_attempts

from cqk_megatron.training import checkpoint

COMMON = ["train.eval_interval=100", "train.checkpoint.hashes=true"]


def _truncate(path: Path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _iterations(checkpoints: Path) -> list[Path]:
    return sorted(p for p in checkpoints.glob("iter_*") if not p.name.endswith(".tmp"))


def _steps(run_dir: Path, kind: str = "train") -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("safety")
    r = str(root)
    run_ranks(
        train_attempts,
        1,
        r,
        [
            (
                "corrupt",
                [
                    *COMMON,
                    "train.train_steps=6",
                    "train.checkpoint.save_interval=2",
                    "train.checkpoint.keep_last=3",
                ],
            ),
            (
                "newer",
                [
                    *COMMON,
                    "train.train_steps=4",
                    "train.checkpoint.save_interval=2",
                    "train.checkpoint.keep_last=1",
                ],
            ),
            ("shape", [*COMMON, "train.train_steps=2", "train.checkpoint.save_interval=2"]),
            (
                "sched",
                [
                    *COMMON,
                    "train.train_steps=8",
                    "train.checkpoint.save_interval=4",
                    "train.resilience.exit_after_steps=4",
                ],
            ),
        ],
    )
    # Every optimizer file truncated, the weights intact: the case.
    for folder in _iterations(root / "corrupt" / "checkpoints"):
        for optimizer in folder.glob("engine/**/*optim_states.pt"):
            _truncate(optimizer)
    # Corrupt folders with higher step numbers than the saves to come.
    checkpoints = root / "newer" / "checkpoints"
    for step in (10, 12):
        copy = checkpoints / f"iter_{step:07d}"
        shutil.copytree(checkpoints / "iter_0000004", copy)
        _truncate(next((copy / "model").glob("*.distcp")))
    (root / "corrupt.before").write_text(json.dumps(folder_listing(root / "corrupt")))
    shape_checkpoint = f"{r}/shape/checkpoints/iter_0000002"
    run_ranks(
        train_attempts,
        1,
        r,
        [
            ("corrupt", [*COMMON, "train.train_steps=8", "train.checkpoint.save_interval=2"]),
            (
                "newer",
                [
                    *COMMON,
                    "train.train_steps=8",
                    "train.checkpoint.save_interval=2",
                    "train.checkpoint.keep_last=1",
                ],
            ),
            ("shape", [*COMMON, "train.train_steps=4", "model.hidden_size=128"]),
            (
                "init-other",
                [
                    *COMMON,
                    "train.train_steps=2",
                    "model.hidden_size=128",
                    f"train.init_from={shape_checkpoint}",
                ],
            ),
            ("sched", [*COMMON, "train.train_steps=10", "train.checkpoint.save_interval=4"]),
            # the ways on that the all-corrupt refusal names
            (
                "corrupt",
                [
                    *COMMON,
                    "train.train_steps=8",
                    "train.checkpoint.save_interval=2",
                    "train.checkpoint.keep_last=3",
                ],
                f"weights:{r}/corrupt/checkpoints/iter_0000006",
            ),
        ],
    )
    return root


def test_all_checkpoints_corrupt_stops_the_run_and_deletes_nothing(runs):
    refused, resumed = attempts(runs, "corrupt")[1:]
    assert refused["error"] == "CheckpointError", refused
    message = refused["message"]
    assert "none of the 3 checkpoint(s)" in message and "nothing was changed" in message
    for step in (2, 4, 6):
        assert f"iter_{step:07d}: " in message and "optim_states.pt" in message
    assert message.count("[weights and trainer state intact]") == 3
    assert f"--resume weights:{runs}/corrupt/checkpoints/iter_0000006" in message
    assert "--resume none" in message
    # not one file changed by the refused attempt: checkpoints, metrics, config
    assert refused["files"] == json.loads((runs / "corrupt.before").read_text())
    # the way on: the weights and step of iter 6, a fresh optimizer, steps 7 and 8
    assert resumed.get("exit") == 0, resumed
    assert (
        "at step 6 (weights and trainer state only, as asked: fresh optimizer)"
        in (resumed["stdout"])
    )
    assert _steps(runs / "corrupt") == list(range(1, 9))
    # the damaged folders stay: fewer than keep_last=3 folders verify yet
    names = [p.name for p in _iterations(runs / "corrupt" / "checkpoints")]
    assert names == [f"iter_{s:07d}" for s in (2, 4, 6, 8)]
    assert (runs / "corrupt" / "checkpoints" / "latest").read_text().strip() == "iter_0000008"


def test_corrupt_newer_folders_never_cost_the_fresh_saves(runs):
    (_, resumed) = attempts(runs, "newer")
    assert resumed.get("exit") == 0, resumed
    checkpoints = runs / "newer" / "checkpoints"
    assert "skipping checkpoint" in resumed["stderr"] and "truncated" in resumed["stderr"]
    latest = (checkpoints / "latest").read_text().strip()
    assert latest == "iter_0000008"
    assert checkpoint.verify(checkpoints / latest) == 8
    # keep_last=1: the fresh save stays, the older verified ones went, the corrupt newer
    # ones were moved aside (superseded), not deleted and not counted
    assert [p.name for p in _iterations(checkpoints)] == ["iter_0000008"]
    moved = list((runs / "newer" / "superseded").glob("*/checkpoints/iter_*"))
    assert sorted(p.name for p in moved) == ["iter_0000010", "iter_0000012"]
    assert "superseded, not deleted" in resumed["stderr"]
    assert _steps(runs / "newer") == list(range(1, 9))


def test_a_checkpoint_of_another_shape_is_refused_naming_the_field(runs):
    (_, changed) = attempts(runs, "shape")
    assert changed["error"] == "CheckpointError", changed
    assert "model.hidden_size=64 (this config: 128)" in changed["message"]
    assert "name=" in changed["message"] and "--resume none" in changed["message"]
    assert "size mismatch" not in changed["message"]
    (init,) = attempts(runs, "init-other")
    assert init["error"] == "CheckpointError", init
    assert "model.hidden_size=64 (this config: 128)" in init["message"]
    assert "train.init_from=" in init["message"]
    # the refused attempt did not rewrite the run's recorded config
    assert "hidden_size: 64" in (runs / "shape" / "config.yaml").read_text()


def test_export_with_a_config_of_another_shape_names_it_instead_of_megatrons_errors(runs):
    """A checkpoint without its own config.yaml is exported with its run's, which a later
    attempt changed: the error says so, not 21 size mismatches."""
    from cqk_megatron.training.checkpoint import write_manifest

    folder = runs / "exported" / "checkpoints" / "iter_0000002"
    shutil.copytree(runs / "shape" / "checkpoints" / "iter_0000002", folder)
    (folder / "config.yaml").unlink()
    write_manifest(folder, 2, with_hashes=False)
    text = (runs / "shape" / "config.yaml").read_text()
    (runs / "exported" / "config.yaml").write_text(
        text.replace("hidden_size: 64", "hidden_size: 128")
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cqk_megatron",
            "convert",
            "export",
            str(folder),
            str(runs / "hf"),
            "--no-tokenizer",
        ],
        env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"cqk convert export: error: checkpoint {folder} does not fit this model" in out.stderr
    assert f"{runs / 'exported' / 'config.yaml'} is not the config this checkpoint" in out.stderr
    assert "Traceback" not in out.stderr and not (runs / "hf").exists()


def test_a_schedule_change_on_resume_is_warned_about(runs):
    stopped, resumed = attempts(runs, "sched")
    assert stopped.get("exit") == 75 and resumed.get("exit") == 0, resumed
    warning = resumed["stderr"]
    assert "warning: the learning-rate schedule differs" in warning
    assert "train.train_steps 8 -> 10" in warning and "at step 4" in warning
    assert _steps(runs / "sched") == list(range(1, 11))


def test_a_crash_and_resume_logs_every_step_once_and_readers_agree(tmp_path):
    """kill -9 after the last save (no chance to write anything): the resumed run's records
    supersede those the crashed one logged past its checkpoint."""
    script = Path(__file__).with_name("_train_script.py")
    # the checkout's package, as the other tests' processes get it (not an installed one)
    env = {
        **os.environ,
        "MASTER_PORT": str(free_port()),
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    }
    args = [
        sys.executable,
        str(script),
        str(tmp_path),
        "crash",
        "train.train_steps=400",
        "train.eval_interval=3",
        "train.checkpoint.save_interval=3",
        "train.checkpoint.hashes=false",
    ]
    process = subprocess.Popen(
        args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
    )
    run_dir = tmp_path / "crash"
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and process.poll() is None:
            done = _steps(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
            if (run_dir / "checkpoints" / "latest").is_file() and len(done) >= 8 and len(done) % 3:
                break
            time.sleep(0.1)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    logged = _steps(run_dir)
    saved = checkpoint.verify(
        run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    )
    assert saved < logged[-1], (saved, logged)  # records past the checkpoint exist
    total = logged[-1] + 4
    finish = subprocess.run(
        [*args[:4], f"train.train_steps={total}", *args[5:]],
        env={**env, "MASTER_PORT": str(free_port())},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finish.returncode == 0, finish.stdout[-2000:] + finish.stderr[-2000:]
    assert f"at step {saved} (exactly)" in finish.stdout
    assert _steps(run_dir) == list(range(1, total + 1))  # each step once, in order
    # the killed process left its lease; the resumed one took it over (same host, dead pid)
    took_over = [line for line in finish.stderr.splitlines() if "from a dead holder" in line]
    assert took_over and f"host {socket.gethostname()}, pid {process.pid}," in took_over[0]
    valid = _steps(run_dir, "valid")
    assert len(valid) == len(set(valid)) and valid == sorted(valid)
    # the readers: one reader, the same answer
    from cqk_megatron.analysis.ingest import read_metrics as ingest_read
    from cqk_megatron.run.folder import run_status
    from launch import run_dir as runs

    lines, problems = ingest_read(run_dir / "metrics.jsonl")
    assert [line["step"] for line in lines if line["kind"] == "train"] == list(range(1, total + 1))
    assert problems == []
    assert runs.latest_train_record(run_dir)["step"] == total
    status = run_status(run_dir, total)
    assert status.state == "finished" and status.summary["steps"] == total


def test_the_reader_supersedes_records_a_resumed_attempt_logged_again(tmp_path):
    """Files written before the writer superseded records (or by two writers at once)."""
    from cqk_megatron.run.folder import read_metrics

    path = tmp_path / "metrics.jsonl"
    records = [
        *({"kind": "train", "step": s, "loss": 5.0 - s} for s in range(1, 6)),
        {"kind": "valid", "step": 4, "val_loss": 9.0},
        {"kind": "summary", "steps": 5},
        # a resume from the checkpoint at step 3, then on to 7
        *({"kind": "train", "step": s, "loss": 1.0 - s} for s in range(4, 8)),
        {"kind": "valid", "step": 4, "val_loss": 1.5},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "tr')
    found = read_metrics(path)
    train = [r for r in found.records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 8))
    assert [r["loss"] for r in train[3:]] == [1.0 - s for s in range(4, 8)]  # the later ones
    assert [r["val_loss"] for r in found.records if r["kind"] == "valid"] == [1.5]
    assert not [r for r in found.records if r["kind"] == "summary"]  # continued past it
    assert found.superseded == 4 and "truncated" in found.problems[0]


def test_retention_keeps_the_fresh_save_and_counts_only_verified_folders(tmp_path):
    from cqk_megatron.run import checkpoint_files

    checkpoints = tmp_path / "checkpoints"

    def make(step: int, good: bool = True) -> Path:
        folder = checkpoint_files.iteration_dir(checkpoints, step)
        (folder / "model").mkdir(parents=True)
        (folder / "model" / "w.distcp").write_bytes(b"x" * 64)
        checkpoint_files.write_manifest(folder, step, with_hashes=False)
        if not good:
            _truncate(folder / "model" / "w.distcp", 10)
        return folder

    for step in (1, 2, 3):
        make(step)
    for step in (50, 60):
        make(step, good=False)
    fresh = make(4)
    deleted = checkpoint_files.retire(checkpoints, keep=2, just_written=fresh)
    assert sorted(p.name for p in deleted) == ["iter_0000001", "iter_0000002"]
    left = [p.name for p in checkpoint_files.iterations(checkpoints)]
    assert left == ["iter_0000003", "iter_0000004", "iter_0000050", "iter_0000060"]
    # fewer verified folders than keep_last: nothing goes
    assert checkpoint_files.retire(checkpoints, keep=5, just_written=fresh) == []
    assert checkpoint_files.repoint_latest(checkpoints).name == "iter_0000004"


# -- a full disk -----------------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path):
    """A 12 MiB tmpfs mounted here (root only), unmounted after."""
    with mounted_tmpfs(tmp_path / "small", "12m") as mount:
        yield mount


def test_a_full_disk_says_no_space_and_keeps_the_previous_checkpoint(tmpfs):
    r = str(tmpfs)
    run = [*COMMON, "train.checkpoint.save_interval=2", "train.checkpoint.keep_last=3"]
    # a first checkpoint, then room for the metrics but not for a second one (2.6 MB)
    steps = [("full", [*run, "train.train_steps=2"]), (FILL, 600_000)]
    steps.append(("full", [*run, "train.train_steps=4"]))
    run_ranks(train_attempts, 2, r, steps, timeout_s=600)
    checkpoints = tmpfs / "full" / "checkpoints"
    first, failed = attempts(tmpfs, "full")
    assert first.get("exit") == 0, first
    assert failed["error"] == "CheckpointSaveError", failed
    message = failed["message"]
    assert "no space left on device" in message and str(checkpoints / "iter_0000004") in message
    assert "free on the filesystem of" in message
    assert "the previous checkpoint iter_0000002 is untouched" in message
    assert checkpoint.verify(checkpoints / "iter_0000002") == 2  # sha256 too
    assert (checkpoints / "latest").read_text().strip() == "iter_0000002"
    assert not (checkpoints / "iter_0000004").exists()
    assert not (checkpoints / "iter_0000004.tmp").exists()  # removed to make room
    # and the pre-flight of cqk-train / the launcher refuses to start it on this disk
    from cqk_megatron.config import load_config
    from cqk_megatron.planner.preflight import PreflightError, check_disk

    config = load_config(
        None,
        [
            "model.vocab_size=64",
            "model.num_layers=2",
            "model.hidden_size=64",
            "model.num_attention_heads=4",
            "name=full",
            f"log.root={r}",
        ],
    )
    with pytest.raises(PreflightError, match="not enough disk for one checkpoint"):
        check_disk(config)
