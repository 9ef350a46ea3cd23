"""The garbage collector kept off what a process holds for its whole life
(``cqk_megatron.training.collector``): imports run with it paused, then frozen."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

from _multiproc import run_ranks

from cqk_megatron.training.collector import freeze_long_lived, heavy_imports

# Full collections while torch is imported, and what stays tracked afterwards.
COUNT_COLLECTIONS = """
import gc, json, sys
full = []
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2
                    and full.append(1))
if sys.argv[1] == "paused":
    from cqk_megatron.training.collector import heavy_imports
    with heavy_imports():
        import torch
else:
    import torch
print(json.dumps({"full": len(full), "frozen": gc.get_freeze_count(),
                  "enabled": gc.isenabled()}))
"""


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_heavy_imports_pauses_the_collector_and_freezes_what_was_made():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with heavy_imports():
            assert not gc.isenabled()
            made = [{"object": k} for k in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(made)
        gc.disable()  # a caller that had it off gets it back off
        with heavy_imports():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()  # this test process's heap goes back to the collector


def test_freeze_long_lived_frees_garbage_before_it_freezes():
    garbage = _Node()
    gone = weakref.ref(garbage)
    del garbage
    try:
        freeze_long_lived()
        assert gone() is None  # collected, not frozen forever
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_importing_torch_under_it_runs_no_full_collection():
    def run(mode: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-c", COUNT_COLLECTIONS, mode],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        return json.loads(out.stdout.splitlines()[-1])

    plain, paused = run("plain"), run("paused")
    assert plain["full"] >= 1 and plain["frozen"] == 0  # what the change avoids
    assert paused["full"] == 0 and paused["enabled"]
    assert paused["frozen"] > 100_000  # torch's objects: out of every later walk


def _report_frozen(rank: int, world_size: int, port: int, out: str) -> None:
    Path(out).write_text(str(gc.get_freeze_count()))


def test_ranks_fork_with_their_imports_frozen(tmp_path):
    # the forkserver's preload (training/preload.py) ran: it fails silently otherwise
    out = tmp_path / "frozen"
    run_ranks(_report_frozen, 1, str(out), timeout_s=300)
    assert int(out.read_text()) > 100_000
