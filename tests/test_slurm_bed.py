"""Without Slurm or without root the Slurm tests skip with their reason and the rest run;
where CI is set they fail (tests/_slurm_bed.py). Programs and the user id are stand-ins
here: the machine running the tests has one answer for each, and both cases are checked."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _slurm_bed import skip_or_fail, slurm_problem

TOOLS = ("munged", "slurmctld", "sbatch")
REPO = Path(__file__).resolve().parents[1]


def _which_missing(*missing: str):
    return lambda tool: None if tool in missing else f"/usr/sbin/{tool}"


def test_missing_programs_are_named_with_the_install_command():
    problem = slurm_problem(TOOLS, which=_which_missing("munged", "sbatch"), euid=lambda: 0)
    assert problem == (
        "Slurm is not installed (no munged, sbatch); "
        "install it with 'bash scripts/slurm/install.sh' (as root)"
    )


def test_without_root_the_reason_says_so():
    problem = slurm_problem(TOOLS, which=_which_missing(), euid=lambda: 1000, root_reason="x")
    assert problem == "x; run the tests as root, or leave these skipped"


def test_installed_and_root_is_no_problem():
    assert slurm_problem(TOOLS, which=_which_missing(), euid=lambda: 0) is None


def test_a_problem_skips_with_its_reason_and_fails_under_ci():
    with pytest.raises(pytest.skip.Exception, match="no sbatch"):
        skip_or_fail("no sbatch", env={})
    with pytest.raises(pytest.fail.Exception, match="no sbatch.*CI is set"):
        skip_or_fail("no sbatch", env={"CI": "true"})


def test_a_skipped_slurm_test_shows_its_reason_and_the_others_run(tmp_path):
    """A module like test_launch.py's, without Slurm: pytest's summary names the reason."""
    (tmp_path / "test_bed.py").write_text(
        textwrap.dedent(
            """
            import pytest
            from _slurm_bed import skip_or_fail, slurm_problem

            @pytest.fixture
            def slurm():
                problem = slurm_problem(("no-such-slurmctld",))
                if problem:
                    skip_or_fail(problem)

            def test_needs_slurm(slurm):
                pass

            def test_needs_nothing():
                pass
            """
        )
    )
    env_path = f"{REPO / 'tests'}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(REPO / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": env_path},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 1 skipped" in done.stdout, done.stdout
    assert "SKIPPED [1]" in done.stdout and "no-such-slurmctld" in done.stdout, done.stdout
