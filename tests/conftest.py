"""Test-session rules shared by every test module.

The suite runs on two pytest-xdist workers in CI (``.ci/run``: ``-n 2``; ``pyproject.toml``
sets ``--dist loadfile --no-loadscope-reorder``).
A module is the unit of scheduling, so that a module's fixtures (many train a reference
run once for all its tests) run on one worker only. The modules go out in the order below,
the longest first, so that the two workers end together instead of one idling while the
other works through a long module that came last (longest-processing-time-first). A
module missing here (a new one) goes after them, in collection order: a stale list only
costs minutes, never a wrong result.
"""

from __future__ import annotations

import os

import pytest

# One compute thread per process, as torchrun gives each rank (and as launch/resources.py
# gives a Slurm task without cpus_per_task): the multi-rank tests put 2-4 ranks, and the two
# workers two tests, on 2 cores, where torch's default of a thread per core makes the
# threads of every rank spin against each other. Set before any test module imports torch,
# and inherited by the ranks and subprocesses the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The modules' wall times, longest first (a profile of the whole suite; CPU-bound modules
# and modules that mostly wait on Slurm or timeouts alike: each takes a worker).
LONGEST_FIRST = [
    "test_launch.py",
    "test_training.py",
    "test_parallel_equivalence.py",
    "test_cluster_tp_pp.py",
    "test_faults.py",
    "test_cluster_matrix.py",
    "test_multinode.py",
    "test_demo.py",
    "test_gpu_path.py",
    "test_mqar.py",
    "test_cancel.py",
    "test_repro.py",
    "test_cluster_zero.py",
    "test_elastic_resume.py",
    "test_safety.py",
    "test_full_disk.py",
    "test_preflight.py",
    "test_launch_status.py",
    "test_async_save.py",
    "test_fuzz.py",
    "test_model_families.py",
    "test_replicas.py",
]


def module_rank(item: pytest.Item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A stable sort keeps each module's tests together and in their order (module fixtures
    # are set up once per module only if its tests stay contiguous).
    items.sort(key=module_rank)
