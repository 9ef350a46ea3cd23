"""Megatron's checkpoint-writer helper ends with the rank that started it.

``preemption.protect_checkpoint_writer`` starts that helper (a multiprocessing manager,
spawned) with SIGTERM and SIGUSR1 ignored, so that Slurm's stop signals do not break the
save they ask for. A rank killed with SIGKILL outside Slurm (torchrun, the local launcher)
then left its helper sleeping forever, deaf to TERM: every run of this suite left two, from
``test_async_save``'s kills. The helper now asks the kernel to kill it when its rank ends,
from an initializer whose module imports no torch, and it holds the write results as
pickled bytes (``writer_queue.py``), so that it never imports torch.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
START_BOUND_S = 300  # importing Megatron and spawning the helper, on a loaded machine

RANK = """
import multiprocessing, signal, sys
import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from cqk_megatron.training.resilience.preemption import protect_checkpoint_writer

protect_checkpoint_writer()
(helper,) = multiprocessing.active_children()
# what a save's writer puts in the queue, {bucket: [WriteResult]}, and what the rank reads
results = {0: [WriteResult(MetadataIndex("w", (0,)), 8, torch.ones(2))]}
filesystem_async._results_queue.put(results)
back = filesystem_async._results_queue.get_nowait()
(result,) = back[0]
assert result.index == results[0][0].index and torch.equal(result.storage_data, torch.ones(2))
print(helper.pid, flush=True)
sys.stdin.read()  # until killed
"""


def alive(pid: int) -> bool:
    """Running or sleeping: not gone and not a zombie waiting for its new parent."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_helper_ignores_stop_signals_and_dies_with_a_rank_killed_by_sigkill():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    helper = None
    try:
        # bounded: a rank that hangs before printing fails the test instead of stalling it
        ready, _, _ = select.select([rank.stdout], [], [], START_BOUND_S)
        assert ready, f"the rank printed no helper pid within {START_BOUND_S} s"
        helper = int(rank.stdout.readline())
        # its initializer's and its manager's modules are torch-free, and it holds the write
        # results pickled: importing torch there cost every rank of every run 1.5 CPU-s at
        # start and 2 CPU-s at its first save (the rank has put and read one when it printed)
        assert "libtorch" not in Path(f"/proc/{helper}/maps").read_text(), "torch imported"
        os.kill(helper, signal.SIGTERM)  # what Slurm sends the whole job step on requeue
        time.sleep(1)
        assert alive(helper), "the helper died of SIGTERM: the save it serves would fail"
        rank.kill()
        rank.wait(timeout=60)
        assert wait_until(lambda: not alive(helper), timeout_s=30), (
            f"the helper (pid {helper}) outlived its rank, killed with SIGKILL"
        )
    finally:
        rank.kill()
        if helper is not None and alive(helper):
            os.kill(helper, signal.SIGKILL)
