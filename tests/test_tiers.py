"""The suite's tiers (tests/_tiers.py): a recorded run orders the modules and marks the
tests that start processes; the recorder sees a process started by a test or a fixture."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A throwaway suite: one module whose test starts a process, one whose module fixture
# does (so every test that uses the fixture needs it), one that starts none.
SUITE = {
    "test_a_alone.py": """
        def test_sum():
            assert 1 + 1 == 2
    """,
    "test_b_command.py": """
        import subprocess, sys

        def test_child():
            subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)

        def test_no_child():
            pass
    """,
    "test_c_fixture.py": """
        import subprocess, sys, pytest

        @pytest.fixture(scope="module")
        def reference():
            subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)
            return 1

        def test_first(reference):
            assert reference == 1

        def test_second(reference):
            assert reference == 1

        def test_without():
            pass
    """,
}

CONFTEST = """
import sys
sys.path.insert(0, {tests!r})
import _tiers
_tiers.TIERS_FILE = _tiers.Path(__file__).parent / "tiers.json"
from _tiers import (Recorder, order_and_mark, pytest_addoption, pytest_fixture_setup,
                    pytest_runtest_call, start_recording)

def pytest_configure(config):
    start_recording(config)
    if config.getoption("--record-tiers"):
        config.pluginmanager.register(Recorder(), "recorder")

def pytest_collection_modifyitems(config, items):
    order_and_mark(items)
"""


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
        + ["--rootdir", str(folder), "-c", "/dev/null", *args, str(folder)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("suite")
    for name, text in SUITE.items():
        (folder / name).write_text(textwrap.dedent(text))
    (folder / "conftest.py").write_text(CONFTEST.format(tests=str(REPO / "tests")))
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n  multiprocess\n  slurm\n")
    recorded = _pytest(folder, "--record-tiers")
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    return folder


def test_the_record_names_what_starts_processes(suite: Path) -> None:
    record = json.loads((suite / "tiers.json").read_text())
    assert set(record["modules"]) == set(SUITE)
    assert record["spawning_fixtures"] == ["test_c_fixture.py::reference"]
    assert "test_b_command.py::test_child" in " ".join(record["spawning_tests"])
    assert not any("test_no_child" in t or "test_a_alone" in t for t in record["spawning_tests"])


def test_the_fast_tier_runs_only_what_starts_no_process(suite: Path) -> None:
    fast = _pytest(suite, "-m", "not multiprocess", "-v", "-v")
    assert fast.returncode == 0, fast.stdout + fast.stderr
    ran = {line.split("::")[1].split()[0] for line in fast.stdout.splitlines() if "::" in line}
    # test_second never starts a process itself, but needs the fixture that does
    assert ran == {"test_sum", "test_no_child", "test_without"}, fast.stdout


def test_modules_go_longest_first(suite: Path) -> None:
    record = json.loads((suite / "tiers.json").read_text())
    record["modules"] = {"test_a_alone.py": 1.0, "test_c_fixture.py": 9.0}  # b: unknown
    (suite / "tiers.json").write_text(json.dumps(record))
    listed = _pytest(suite, "--collect-only")
    modules = [line.split("::")[0] for line in listed.stdout.splitlines() if "::" in line]
    order = list(dict.fromkeys(modules))
    assert order == ["test_c_fixture.py", "test_a_alone.py", "test_b_command.py"], order
