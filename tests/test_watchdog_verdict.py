"""The watchdog names the rank that stopped, not the ranks that wait for it.

Three gloo ranks, each with its real watchdog on the job's TCPStore. After one collective
that all complete, rank 1 is held while ranks 0 and 2 issue the next all-reduce and wait
for it in ``work.wait()``, called from this file: their main threads block outside
``torch.distributed``, as a healthy rank's does under NCCL (in ``.item()``, a device
synchronize, or Megatron's and DeepSpeed's own ``wait()`` on an overlapped reduction).
Rank 1 is held either before the collective, in its own code, or inside
``torch.distributed``'s Python code, before the collective is issued (a frame whose file
is under ``torch/distributed/``: c10d has no place to hold a rank in, so the test makes
one). Every rank's verdict, in ``RUN/faults.jsonl``, must name rank 1 alone.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _multiproc import run_ranks

from cqk_megatron.run.folder import FAULTS
from cqk_megatron.training.resilience.progress import stopped_ranks
from cqk_megatron.training.resilience.watchdog import Bounds, Watchdog

HELD = 1
WORLD = 3
BOUNDS = Bounds(interval_s=0.1, heartbeat_timeout_s=2.0, init_s=1.5, step_s=1.5)


def hold_before_the_collective() -> None:
    time.sleep(120)  # ended by the watchdog's exit


# The same wait, in a frame that the watchdog reads as being inside torch.distributed.
_INSIDE = os.path.join(os.path.dirname(dist.__file__), "_held_by_test.py")
_namespace: dict = {"time": time}
exec(compile("def hold():\n    time.sleep(120)\n", _INSIDE, "exec"), _namespace)  # noqa: S102
hold_inside_the_collective = _namespace["hold"]

HOLDS = {"before": hold_before_the_collective, "inside": hold_inside_the_collective}


def held_rank_job(rank: int, world_size: int, port: int, run_dir: str, hold: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    dog = Watchdog(rank, world_size, "127.0.0.1", port, BOUNDS, run_dir=Path(run_dir)).start()
    values = torch.ones(4)
    dist.all_reduce(values)  # one collective that every rank completes
    dog.enter("step", 1)
    if rank == HELD:
        HOLDS[hold]()
    else:
        dist.all_reduce(values, async_op=True).wait()  # waits here, outside torch.distributed
    time.sleep(120)


@pytest.mark.parametrize("hold", sorted(HOLDS))
def test_the_verdict_names_the_held_rank(tmp_path, hold):
    try:
        run_ranks(held_rank_job, WORLD, str(tmp_path), hold, timeout_s=90)
    except Exception as error:  # noqa: BLE001 - the watchdog ends the ranks with exit 76
        assert "76" in str(error) or "exit code" in str(error), error
    records = [json.loads(line) for line in (tmp_path / FAULTS).read_text().splitlines()]
    verdicts = [r for r in records if r.get("event") == "lost"]
    assert verdicts, records
    for record in verdicts:
        assert record["ranks"] == [HELD], record["line"]
        assert (record["step"], record["phase"]) == (1, "step")
        assert (
            "issued 1 collectives" in record["reason"] and "its peers issued 2" in record["reason"]
        )


def _state(issued: dict[str, int]) -> dict:
    return {"issued": issued}


def test_stopped_ranks_follow_the_chain_of_waits():
    """Rank 2 stopped on group b; rank 0 waits for it there, so it is itself behind on
    group a, where rank 1 waits for it: rank 2 alone is named."""
    states = {
        0: _state({"a": 5, "b": 8}),
        1: _state({"a": 6}),
        2: _state({"b": 7}),
    }
    assert stopped_ranks(states)[0] == [2]
    assert stopped_ranks({0: _state({"a": 3}), 1: _state({"a": 3})}) == ([], "")
