"""The suite's tiers and module order, from a measured run rather than a hand-kept list.

``pytest --record-tiers tests`` (any ``-n``) measures every test and writes
``tests/tiers.json``: each module's seconds (setup, call and teardown of its tests) and
which tests and fixtures start a process (``subprocess``, ``multiprocessing``, ``os.fork``).
Every other run reads it:

- the modules go out longest first, so that the xdist workers end together
  (longest-processing-time-first); a module the file does not know goes last;
- a test that starts a process, or uses a fixture that does, is marked ``multiprocess``;
  one that uses the ``slurm`` fixture is marked ``slurm`` too. The fast tier is
  ``-m "not multiprocess"``: every test that runs in the pytest process alone.

A stale file costs minutes, never a wrong result: a new test is unmarked (it runs in the
fast tier until the next recording) and a new module goes last.
"""

from __future__ import annotations

import json
import multiprocessing.process
import os
import subprocess
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

TIERS_FILE = Path(__file__).resolve().parent / "tiers.json"
STARTS_PROCESSES = "starts_processes"  # a user property: the phase started a process
SPAWNING_FIXTURE = "spawning_fixture"  # a user property: this fixture started one


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-tiers",
        action="store_true",
        help=f"measure every test and write {TIERS_FILE.name} (module order and markers)",
    )


def recorded() -> dict[str, Any]:
    if not TIERS_FILE.exists():
        return {"modules": {}, "spawning_tests": [], "spawning_fixtures": []}
    return json.loads(TIERS_FILE.read_text())


# -- reading: order and markers ----------------------------------------------------------------


def order_and_mark(items: list[pytest.Item]) -> None:
    tiers = recorded()
    seconds: dict[str, float] = tiers["modules"]
    spawning_tests = set(tiers["spawning_tests"])
    spawning_fixtures = set(tiers["spawning_fixtures"])
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if "slurm" in names:
            item.add_marker(pytest.mark.slurm)
            item.add_marker(pytest.mark.multiprocess)
        elif item.nodeid in spawning_tests or {f"{item.path.name}::{n}" for n in names} & (
            spawning_fixtures
        ):
            item.add_marker(pytest.mark.multiprocess)
    # Stable: each module's tests stay together and in order (module fixtures set up once).
    items.sort(key=lambda item: -seconds.get(item.path.name, -1.0))


# -- recording -------------------------------------------------------------------------------


class _SpawnWatch:
    """Counts the processes started in this process while it is installed."""

    def __init__(self) -> None:
        self.count = 0
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        self._wrap(subprocess.Popen, "_execute_child")
        self._wrap(multiprocessing.process.BaseProcess, "start")
        self._wrap(os, "fork")

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)
        self._undo.append(lambda: setattr(owner, name, original))


_WATCH = _SpawnWatch()


def start_recording(config: pytest.Config) -> None:
    if config.getoption("--record-tiers"):
        _WATCH.install()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Iterator[None]:
    before = _WATCH.count
    yield
    item = getattr(request, "_pyfuncitem", None)  # the test this set-up runs for
    if _WATCH.count > before and item is not None and request.config.getoption("--record-tiers"):
        item.user_properties.append((SPAWNING_FIXTURE, f"{item.path.name}::{fixturedef.argname}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    before = _WATCH.count
    yield
    if _WATCH.count > before and item.config.getoption("--record-tiers"):
        item.user_properties.append((STARTS_PROCESSES, True))


class Recorder:
    """On the controlling process (xdist's too): sums each module's seconds from the
    reports and collects the spawn notes the workers attach to them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.tests: set[str] = set()
        self.fixtures: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = report.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
        self.seconds[module] += report.duration
        for key, value in report.user_properties:
            if key == STARTS_PROCESSES:
                self.tests.add(report.nodeid)
            elif key == SPAWNING_FIXTURE:
                self.fixtures.add(str(value))
                self.tests.add(report.nodeid)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if getattr(session.config, "workerinput", None) is not None:
            return  # an xdist worker: the controller writes the file
        record = {
            "modules": {m: round(s, 1) for m, s in sorted(self.seconds.items())},
            "spawning_tests": sorted(self.tests),
            "spawning_fixtures": sorted(self.fixtures),
        }
        TIERS_FILE.write_text(json.dumps(record, indent=1) + "\n")
