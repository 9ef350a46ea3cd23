"""Asynchronous checkpoint saves (``train.checkpoint.async_save``, training/async_save.py), 2 ranks.

The background write is held for a number of step boundaries through a test-only hook
(``CQK_TEST_ASYNC_SAVE_HOLD_STEPS``, read in one place in async_writer.Writer): without it
a tiny model's write finishes within a step on a fast disk, and whether steps ran
during it would depend on this machine's speed. With it the order is deterministic, and
every check here is on the order of events (which checkpoints existed when each step
fetched its data, ``_async_save_workers.Observed``), never on wall-clock time.

Runs (8 steps, a save every 3 steps: iter 3, 6 and the final 8):
- ``sync``: synchronous saves, the reference;
- ``async``: asynchronous saves, each write held 2 step boundaries;
- ``killed``: asynchronous, every rank SIGKILLed as step 7 fetches its data while iter 6
  is still being written (rank 0 records its child processes first); then resumed
  (synchronously) to the end;
- ``stopped``: asynchronous, every rank SIGTERMed as step 7 fetches its data, while
  iter 6 is being written: the stop saves step 7, waits for both and exits 75; resumed.
"""

from __future__ import annotations

import json
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from _async_save_workers import observed_run
from _multiproc import run_ranks
from _training import records

from cqk_megatron.errors import EXIT_REQUEUE
from cqk_megatron.run.checkpoint_files import verify
from cqk_megatron.training.async_save import host_copy
from cqk_megatron.training.async_writer import HOLD_STEPS_ENV, Staged, Writer

BASE = [
    "train.train_steps=8",
    "train.checkpoint.save_interval=3",
    "train.eval_interval=100",
    "train.checkpoint.keep_last=5",
]
ASYNC = [*BASE, "train.checkpoint.async_save=true"]
HOLD = 2  # step boundaries each background write is held for


def observed(root: Path, name: str) -> dict[int, dict]:
    lines = (root / f"{name}.observed.jsonl").read_text().splitlines()
    return {entry["step"]: entry for entry in map(json.loads, lines)}


def losses(root: Path, name: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(root, name, "train")}


def exit_codes(root: Path, name: str) -> list[str]:
    path = root / f"{name}.exit"
    return path.read_text().split() if path.exists() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    engine = request.param
    root = tmp_path_factory.mktemp(f"async-{engine}")
    args = (str(root),)
    engine_override = [f"train.engine={engine}"]
    run_ranks(observed_run, 2, *args, "sync", [*BASE, *engine_override], 0, None)
    run_ranks(observed_run, 2, *args, "async", [*ASYNC, *engine_override], HOLD, None)
    if engine == "deepspeed":  # the stop and kill drills: one engine is enough
        with pytest.raises(Exception, match="signal SIGKILL"):
            run_ranks(observed_run, 2, *args, "killed", ASYNC, 100, ("kill", 7))
        (root / "killed.after-kill").write_text(
            json.dumps(sorted(p.name for p in (root / "killed/checkpoints").iterdir()))
        )
        run_ranks(observed_run, 2, *args, "killed", BASE, 0, None)
        run_ranks(observed_run, 2, *args, "stopped", ASYNC, 100, ("term", 7))
        (root / "stopped.after-stop").write_text(
            json.dumps(sorted(p.name for p in (root / "stopped/checkpoints").iterdir()))
        )
        run_ranks(observed_run, 2, *args, "stopped", ASYNC, 0, None)
    return root


ENGINES = pytest.mark.parametrize("runs", ["deepspeed", "megatron"], indirect=True)
DEEPSPEED = pytest.mark.parametrize("runs", ["deepspeed"], indirect=True)


@ENGINES
def test_steps_train_while_the_write_is_in_flight(runs):
    """Steps 4 and 5 fetch their data while iter 3 is staged (its .tmp folder exists)
    but not committed; a synchronous save commits it before step 4."""
    seen = observed(runs, "async")
    for step in (4, 5):
        assert "iter_0000003.tmp" in seen[step]["folders"], seen[step]
        assert "iter_0000003" not in seen[step]["folders"], seen[step]
        assert seen[step]["latest"] is None
    assert seen[7]["latest"] == "iter_0000003"  # committed by step 6's save at the latest
    assert observed(runs, "sync")[4]["latest"] == "iter_0000003"
    assert exit_codes(runs, "async") == ["0"]


def same_files(sync: Path, asynchronous: Path) -> list[str]:
    """The files of two checkpoint folders that differ, compared byte for byte except
    what differs between any two saves: ``torch.save`` writes a random serialization id
    into each file (every other record of its zip archive is compared), a distributed
    checkpoint's ``.metadata`` holds the folder's path and a random id, ``config.yaml``
    the run's name, and ``manifest.json`` those files' digests."""
    names = {str(p.relative_to(sync)) for p in sync.rglob("*") if p.is_file()}
    other = {str(p.relative_to(asynchronous)) for p in asynchronous.rglob("*") if p.is_file()}
    differ = sorted(names ^ other)
    for name in sorted(names & other):
        if name in ("config.yaml", "manifest.json") or name.endswith(".metadata"):
            continue
        if name.endswith(".pt"):
            same = zip_records(sync / name) == zip_records(asynchronous / name)
        else:
            same = (sync / name).read_bytes() == (asynchronous / name).read_bytes()
        if not same:
            differ.append(name)
    return differ


def zip_records(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {
            n: archive.read(n) for n in archive.namelist() if not n.endswith("serialization_id")
        }


@ENGINES
def test_async_saves_equal_sync_saves_bit_for_bit(runs):
    """Same losses, and every checkpoint file (weights, engine state, trainer state)
    holds the same bytes as the synchronous run's (``same_files``)."""
    assert losses(runs, "async") == losses(runs, "sync")
    for iteration in ("iter_0000003", "iter_0000006", "iter_0000008"):
        sync, asynchronous = runs / "sync/checkpoints", runs / "async/checkpoints"
        assert not same_files(sync / iteration, asynchronous / iteration), iteration
    assert (runs / "async/checkpoints/latest").read_text().strip() == "iter_0000008"


@DEEPSPEED
def test_kill_during_the_write_keeps_the_previous_checkpoint(runs):
    """SIGKILL while iter 6 is written: its .tmp is left, ``latest`` is iter 3, and the
    resume from it ends where the uninterrupted run does, bit for bit."""
    after_kill = json.loads((runs / "killed.after-kill").read_text())
    assert "iter_0000006.tmp" in after_kill and "iter_0000006" not in after_kill
    assert "iter_0000003" in after_kill
    reference = losses(runs, "sync")
    resumed = [r for r in records(runs, "killed", "train") if r["step"] >= 4]
    assert {r["step"]: r["loss"] for r in resumed} == {s: reference[s] for s in range(4, 9)}
    checkpoints = "checkpoints/iter_0000008"
    assert not same_files(runs / "sync" / checkpoints, runs / "killed" / checkpoints)


@DEEPSPEED
def test_a_killed_rank_leaves_no_writer_process_behind(runs):
    """Rank 0's children as it was SIGKILLed, iter 6's write in flight: its checkpoint
    writer (a fork of the rank, held: it would wait long after the kill) and Megatron's
    results helper; every one of them is gone, by the time the resumed run has ended."""
    children = json.loads((runs / "killed.observed.jsonl.children").read_text())
    assert [child["writer"] for child in children].count(True) == 1, children
    alive = [child for child in children if running(child["pid"])]
    assert not alive, f"outlived their SIGKILLed rank: {alive}"


def running(pid: int) -> bool:
    """Running or sleeping: not gone and not a zombie waiting for its new parent."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@DEEPSPEED
def test_sigterm_during_the_write_waits_for_it_then_exits_75(runs):
    """SIGTERM while iter 6 is written: the stop saves step 7, and the exit (75) comes
    after both are committed and verify; the resume finishes as the reference does."""
    signalled = observed(runs, "stopped")[7]  # SIGTERM came as step 7 fetched its data
    assert "iter_0000006.tmp" in signalled["folders"], signalled  # iter 6 in flight then
    assert exit_codes(runs, "stopped") == [str(EXIT_REQUEUE), "0"]
    after_stop = json.loads((runs / "stopped.after-stop").read_text())
    assert {"iter_0000006", "iter_0000007", "latest"} <= set(after_stop)
    assert not [name for name in after_stop if name.endswith(".tmp")]
    assert verify(runs / "stopped/checkpoints/iter_0000006") == 6
    assert (runs / "stopped/checkpoints/latest").read_text().strip() == "iter_0000008"
    checkpoints = "checkpoints/iter_0000006"
    assert not same_files(runs / "sync" / checkpoints, runs / "stopped" / checkpoints)
    assert losses(runs, "stopped") == losses(runs, "sync")


def test_host_copy_keeps_what_torch_save_writes_and_is_a_copy():
    """``host_copy`` (staging): a ``torch.Size`` (in DeepSpeed's ``param_shapes``, rank 0
    only: its failure there once left the other rank in DeepSpeed's barrier), a
    ``state_dict``'s ``_metadata``, and storage shared between two views, kept; the
    tensors are copies, which the next optimizer step does not change."""
    weights = torch.arange(6.0)
    state = OrderedDict(flat=weights, view=weights[2:4])
    state._metadata = {"": {"version": 1}}
    copied = host_copy({"shapes": OrderedDict(w=torch.Size([2, 3])), "state": state})
    assert copied["shapes"]["w"] == torch.Size([2, 3])
    assert copied["state"]._metadata == state._metadata
    flat, view = copied["state"]["flat"], copied["state"]["view"]
    assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert view.storage_offset() == 2
    weights.add_(1.0)
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_host_copy_pickles_to_the_same_bytes(tmp_path):
    """``torch.save`` of the copy writes what it writes for the original: an object met
    twice (DeepSpeed's ``betas`` tuple in each param group) is pickled once in both, and
    a plain tensor's ``requires_grad`` (DeepSpeed's fp32 partitions) is kept."""
    partition = torch.zeros(4, requires_grad=True)
    betas = (0.9, 0.95)
    state = {"groups": [{"betas": betas}, {"betas": betas}], "fp32": [partition]}
    for name, saved in (("original", state), ("copy", host_copy(state))):
        (tmp_path / name).mkdir()
        torch.save(saved, tmp_path / name / "state.pt")  # the archive is named after the file
    assert zip_records(tmp_path / "original/state.pt") == zip_records(tmp_path / "copy/state.pt")


def _one_file(path: Path) -> Staged:
    return Staged(files=[(path, {"w": torch.ones(2)}, {"args": (), "kwargs": {}})])


def test_a_write_past_its_time_is_killed_and_reaped(tmp_path, monkeypatch):
    """A writer that has not ended when the rank stops waiting (``train.resilience.save_timeout_s``
    in ``PendingSave.wait``; here a write held until released, which never comes) is
    killed, reaped and writes nothing more."""
    monkeypatch.setenv(HOLD_STEPS_ENV, "1")
    writer = Writer(_one_file(tmp_path / "state.pt"), tmp_path, False, rank=0)
    writer.start()
    pid = writer.pid
    writer.join(0.5)
    assert writer.is_alive()
    writer.kill()
    assert not writer.is_alive() and not running(pid)
    assert not (tmp_path / "state.pt").exists()


def test_a_failed_write_comes_back_from_the_writer_process(tmp_path):
    """The writer's first failure (here a folder that is a file) comes back to the rank,
    type and all, and the files it did write are hashed only when it succeeds."""
    (tmp_path / "model").write_text("not a folder")
    writer = Writer(_one_file(tmp_path / "model" / "state.pt"), tmp_path, True, rank=0)
    writer.start()
    writer.join(60)
    assert not writer.is_alive()
    assert isinstance(writer.error, OSError), writer.error
    assert writer.digests == {}
    good = Writer(_one_file(tmp_path / "good" / "state.pt"), tmp_path, True, rank=0)
    good.start()
    good.join(60)
    assert good.error is None and list(good.digests) == ["good/state.pt"]
    assert torch.equal(torch.load(tmp_path / "good/state.pt")["w"], torch.ones(2))
