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
import shutil
import tempfile

import pytest

# One compute thread per process, as torchrun gives each rank (and as launch/resources.py
# gives a Slurm task without cpus_per_task): the multi-rank tests put 2-4 ranks, and the two
# workers two tests, on 2 cores, where torch's default of a thread per core makes the
# threads of every rank spin against each other. Set before any test module imports torch,
# and inherited by the ranks and subprocesses the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The launcher notes every run it submits in an index of the account
# ($XDG_STATE_HOME/cqk-megatron/runs.jsonl, launch/run_dir.py), which ``status NAME`` reads:
# the suite's runs go to an index of this test process, so that they never land in the
# user's own, and a run name a test submits is not made ambiguous by an earlier test run's.
_STATE_HOME = tempfile.mkdtemp(prefix="cqk-test-state-")
os.environ["XDG_STATE_HOME"] = _STATE_HOME

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


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_STATE_HOME, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order_and_mark(items)
