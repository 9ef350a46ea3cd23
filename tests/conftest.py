"""Test-session rules shared by every test module.

The suite runs on two pytest-xdist workers in CI (``.ci/run``: ``-n 2``; ``pyproject.toml``
sets ``--dist loadfile --no-loadscope-reorder``). A module is the unit of scheduling, so
that a module's fixtures (many train a reference run once for all its tests) run on one
worker only. The order of the modules (longest first) and the tiers' markers come from a
measured run recorded in ``tests/tiers.json`` (``tests/_tiers.py``; ``--record-tiers``
records it again).
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

from _tiers import (  # noqa: E402  (after the thread count, before torch)
    Recorder,
    order_and_mark,
    pytest_addoption,  # noqa: F401  (a hook: pytest finds it here)
    pytest_fixture_setup,  # noqa: F401
    pytest_runtest_call,  # noqa: F401
    start_recording,
)


def pytest_configure(config: pytest.Config) -> None:
    start_recording(config)
    if config.getoption("--record-tiers"):
        config.pluginmanager.register(Recorder(), "cqk-tiers-recorder")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order_and_mark(items)
