"""Workers for tests/test_async_save.py: the real training loop in spawned ranks, with a
training set that records, as each step fetches its first sample, which checkpoints
exist (so a test sees what was committed before which step) and that can kill or stop
its own rank at a chosen step."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

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
