"""Whether the Slurm tests can run here, and what they do when they cannot.

The tests of the real Slurm daemons (tests/test_launch.py, tests/test_multinode.py) need
Slurm's programs (``bash scripts/slurm/install.sh``: Debian's packages, root) and root to
start the daemons. Without them those tests are skipped, each with the reason (pytest
prints skip reasons: ``-rs`` in pyproject.toml), and every other test runs. Where ``CI``
is set they fail instead: CI installs Slurm, so a missing one there is a broken CI.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Mapping

import pytest

INSTALL_HINT = "install it with 'bash scripts/slurm/install.sh' (as root)"


def slurm_problem(
    tools: Iterable[str],
    *,
    which: Callable[[str], str | None] = shutil.which,
    euid: Callable[[], int] = os.geteuid,
    root_reason: str = "starting the Slurm daemons needs root",
) -> str | None:
    """Why the Slurm tests cannot run here (None if they can): programs missing, or not
    root."""
    missing = [tool for tool in tools if which(tool) is None]
    if missing:
        return f"Slurm is not installed (no {', '.join(missing)}); {INSTALL_HINT}"
    if euid() != 0:
        return f"{root_reason}; run the tests as root, or leave these skipped"
    return None


def skip_or_fail(problem: str, env: Mapping[str, str] | None = None) -> None:
    """Skip the test with ``problem`` as its reason; fail it where ``CI`` is set."""
    env = os.environ if env is None else env
    if env.get("CI"):
        pytest.fail(f"{problem} (CI is set: CI installs Slurm)")
    pytest.skip(problem)
