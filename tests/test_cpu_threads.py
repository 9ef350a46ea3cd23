"""``cqk train`` on CPU gives torch one share of the usable cores per rank of the node
(``cqk_megatron/parallel/cpu_threads.py``) and says so in one line; ``OMP_NUM_THREADS``
set by the user wins."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cqk_megatron.parallel.cpu_threads import choose_threads, ranks_on_node, usable_cores

REPO = Path(__file__).resolve().parents[1]


def test_the_usable_cores_share_evenly_among_the_ranks_on_the_node():
    assert choose_threads({}, cores=8).threads == 8
    assert choose_threads({"LOCAL_WORLD_SIZE": "2"}, cores=8).threads == 4
    assert choose_threads({"LOCAL_WORLD_SIZE": "3"}, cores=8).threads == 2
    assert choose_threads({"SLURM_NTASKS_PER_NODE": "4"}, cores=8).threads == 2
    assert choose_threads({"LOCAL_WORLD_SIZE": "4"}, cores=2).threads == 1  # never 0
    choice = choose_threads({"LOCAL_WORLD_SIZE": "4"}, cores=16)
    assert choice.line() == "torch threads per rank: 4 (16 usable cores / 4 rank(s) on this node)"


def test_omp_num_threads_set_by_the_user_wins():
    choice = choose_threads({"OMP_NUM_THREADS": "3", "LOCAL_WORLD_SIZE": "4"}, cores=2)
    assert (choice.threads, choice.why) == (3, "OMP_NUM_THREADS is set")
    # a value that is not a count (OpenMP's nested "4,2", empty) leaves the choice to us
    assert choose_threads({"OMP_NUM_THREADS": "4,2"}, cores=6).threads == 6
    assert choose_threads({"OMP_NUM_THREADS": ""}, cores=6).threads == 6


def test_ranks_on_node_reads_torchrun_then_srun_and_is_one_alone():
    assert ranks_on_node({}) == 1
    assert ranks_on_node({"LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "8"}) == 2
    assert ranks_on_node({"LOCAL_WORLD_SIZE": "x", "SLURM_NTASKS_PER_NODE": "8"}) == 8


def test_usable_cores_is_this_process_affinity():
    assert usable_cores() == len(os.sched_getaffinity(0))


def _train_threads_line(tmp_path: Path, **env: str) -> str:
    """The thread line of a 2-step ``cqk train`` of the tiny model."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cqk_megatron",
            "train",
            "--config",
            "configs/runs/tiny_cpu.yaml",
            "train.train_steps=2",
            "train.checkpoint.save_interval=100",
            f"log.root={tmp_path}",
            f"name=threads-{len(env)}",
        ],
        cwd=REPO,
        env={**base, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = re.findall(r"^torch threads per rank: .*$", done.stderr, re.MULTILINE)
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("given", [None, "1"])
def test_cqk_train_on_cpu_sets_and_prints_its_thread_count(tmp_path, given):
    if given is None:
        cores = len(os.sched_getaffinity(0))
        expected = (
            f"torch threads per rank: {cores} ({cores} usable cores / 1 rank(s) on this node)"
        )
        assert _train_threads_line(tmp_path) == expected
    else:
        line = _train_threads_line(tmp_path, OMP_NUM_THREADS=given)
        assert line == "torch threads per rank: 1 (OMP_NUM_THREADS is set)"
