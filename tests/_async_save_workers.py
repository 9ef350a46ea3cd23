"""Workers for tests/test_async_save.py: the real training loop in spawned ranks, with a
training set that records, as each step fetches its first sample, which checkpoints
exist (so a test sees what was committed before which step) and that can kill or stop
its own rank at a chosen step."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
from _training import config_for, set_rank_env, synthetic_datasets

from cqk_megatron.run.checkpoint_files import LATEST


class Observed:
    """A training set that, at the first fetch of each step (rank 0 records), writes
    ``{"step", "folders", "latest"}`` to ``record``, and at step ``act_at`` sends itself
    ``action`` (``"kill"``: SIGKILL, ``"term"``: SIGTERM, as Slurm signals every rank)."""

    def __init__(self, inner, checkpoints: Path, record: Path | None, global_batch: int, act):
        self.inner, self.checkpoints, self.record = inner, checkpoints, record
        self.global_batch, self.act, self.seen = global_batch, act, set()

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index):
        step = index // self.global_batch + 1
        if step not in self.seen:
            self.seen.add(step)
            self._observe(step)
        return self.inner[index]

    def _observe(self, step: int) -> None:
        if self.record is not None:
            latest = self.checkpoints / LATEST
            entry = {
                "step": step,
                "folders": sorted(p.name for p in self.checkpoints.glob("iter_*")),
                "latest": latest.read_text().strip() if latest.is_file() else None,
            }
            with self.record.open("a") as handle:
                handle.write(json.dumps(entry) + "\n")
        if self.act is not None and step == self.act[1]:
            if self.act[0] == "kill" and self.record is not None:
                self._record_children()
            os.kill(os.getpid(), signal.SIGKILL if self.act[0] == "kill" else signal.SIGTERM)

    def _record_children(self) -> None:
        """This rank's child processes, as ``{"pid", "writer"}`` to ``record.children``
        (a writer is a fork of the rank: the same command line; Megatron's results helper
        is spawned, with its own)."""
        own = Path("/proc/self/cmdline").read_bytes()
        children = []
        for task in Path("/proc/self/task").iterdir():
            for pid in (task / "children").read_text().split():
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                children.append({"pid": int(pid), "writer": cmdline == own})
        Path(f"{self.record}.children").write_text(json.dumps(children))


def observed_run(rank, world_size, port, root, name, overrides, hold_steps, act) -> None:
    """Train run ``root/name`` (resuming it if it has checkpoints) with the background
    write held for ``hold_steps`` step boundaries; rank 0 appends the exit code to
    ``root/name.exit``."""
    set_rank_env(rank, world_size, port)
    os.environ["CQK_TEST_ASYNC_SAVE_HOLD_STEPS"] = str(hold_steps)
    from cqk_megatron.training.loop import train

    config = config_for(root, name, overrides)
    train_data, valid_data = synthetic_datasets(config)
    record = Path(root, f"{name}.observed.jsonl") if rank == 0 else None
    checkpoints = Path(root, name, "checkpoints")
    observed = Observed(train_data, checkpoints, record, config.train.global_batch_size, act)
    outcome = train(config, datasets=(observed, valid_data))
    if rank == 0:
        with Path(root, f"{name}.exit").open("a") as handle:
            handle.write(f"{outcome}\n")


STALL_JOIN_BOUND_S = 60.0  # a stall-test write that has not ended by then fails the test


def _small_step(a, b) -> None:
    """A training step's worth of work for the stall test: tiny, so that the gaps between
    steps are the writer's doing, not the step's."""
    torch.mm(a, b)


class ThreadClock:
    """The calling thread's time on a CPU plus its time waiting in the run queue for one
    (``/proc/thread-self/schedstat``, nanoseconds): what a gap between two steps spent
    running or waiting for a CPU that other processes held. The rest of the gap the thread
    was blocked: on a lock (the interpreter's, held by a writer thread), a page, a file.
    Zero where the kernel does not say (then the whole gap counts as blocked)."""

    PATH = "/proc/thread-self/schedstat"

    def __init__(self) -> None:
        self.fd = os.open(self.PATH, os.O_RDONLY) if os.path.exists(self.PATH) else None

    def __call__(self) -> float:
        if self.fd is None:
            return 0.0
        running, waiting = os.pread(self.fd, 128, 0).split()[:2]
        return (int(running) + int(waiting)) / 1e9

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


def _voluntary_switches() -> int:
    """How many times the calling thread has slept (on a lock, a page, a file) so far."""
    for line in Path("/proc/thread-self/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    return 0


def _one_save(folder: Path, state: dict) -> dict:
    """Stage ``state`` (host copy), start its write, and step the training thread until
    the write has ended, timestamping each step (wall clock, and ``ThreadClock``). The
    staging copy and the writer's start are timed apart from the stall: they are the
    stage, which training waits for anyway."""
    from cqk_megatron.training.async_save import Staged, Writer, host_copy

    a, b = torch.ones(16, 16), torch.ones(16, 16)
    clock = ThreadClock()
    began = time.perf_counter()
    staged = Staged(files=[(folder / "state.pt", host_copy(state), {"args": (), "kwargs": {}})])
    copied = time.perf_counter()
    writer = Writer(staged, folder, True)
    writer.start()
    waits_before = _voluntary_switches()
    stamps = [(time.perf_counter(), clock())]
    while writer.is_alive():
        _small_step(a, b)
        stamps.append((time.perf_counter(), clock()))
    waits = _voluntary_switches() - waits_before
    writer.join(STALL_JOIN_BOUND_S)
    clock.close()
    pairs = list(zip(stamps, stamps[1:], strict=False))
    gaps = [later[0] - earlier[0] for earlier, later in pairs]
    blocked = [(later[0] - earlier[0]) - (later[1] - earlier[1]) for earlier, later in pairs]
    return {
        "staging_s": copied - began,
        "start_s": stamps[0][0] - copied,
        "write_s": stamps[-1][0] - stamps[0][0],
        "stall_s": max(blocked, default=0.0),
        "gap_s": max(gaps, default=0.0),
        "steps": len(gaps),
        "waits": waits,
        "error": None if writer.error is None else repr(writer.error),
        "hashed": sorted(writer.digests),
    }


def stall_run(rank, world_size, port, root, size_mib, repeats) -> None:
    """One rank (a gloo group of one: the writer hashes what this rank wrote): ``repeats``
    asynchronous saves of a ``size_mib`` MiB state, each measured by ``_one_save``; the
    results, and whether each file loads back equal, go to ``root/stalls.json``."""
    import torch.distributed as dist

    set_rank_env(rank, world_size, port)
    torch.set_num_threads(1)  # one training thread, as the stall is measured on
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    # one flat fp32 buffer, as the engines keep their parameters and optimizer state, and
    # a few small tensors beside it
    flat = torch.arange(size_mib * (1 << 20) // 4, dtype=torch.float32)
    state = {"weights": [flat, *(torch.full((1024,), float(i)) for i in range(3))], "step": 7}
    results = []
    for attempt in range(repeats):
        folder = Path(root, f"save{attempt}")
        folder.mkdir()
        result = _one_save(folder, state)
        loaded = torch.load(folder / "state.pt", weights_only=True)
        result["equal"] = loaded["step"] == 7 and all(
            torch.equal(x, y) for x, y in zip(loaded["weights"], state["weights"], strict=True)
        )
        (folder / "state.pt").unlink()  # one file on disk at a time
        results.append(result)
    Path(root, "stalls.json").write_text(json.dumps(results))
    dist.destroy_process_group()
