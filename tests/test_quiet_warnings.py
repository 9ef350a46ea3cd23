"""Megatron-Core's import warnings about Apex and Transformer Engine (seven, fourteen
lines, on every command that imports it) are hidden from ``cqk`` commands and from a rank
started as ``python -m cqk_megatron.train``; ``cqk --verbose`` shows them
(``cqk_megatron/cli/quiet.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HIDDEN = ("Apex is not installed", "Transformer Engine and Apex are not installed")


def run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "CQK_VERBOSE")}
    done = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _megatron_warns_here() -> bool:
    """Whether this install lacks Apex (then Megatron-Core warns as it loads)."""
    try:
        import apex  # noqa: F401
    except ImportError:
        return True
    return False


pytestmark = pytest.mark.skipif(
    not _megatron_warns_here(), reason="Apex is installed: Megatron-Core has nothing to warn of"
)


def test_cqk_params_prints_no_third_party_warning_and_verbose_shows_them(tmp_path):
    params = ("-m", "cqk_megatron", "params", "--config", "configs/models/60m.yaml")
    quiet = run(*params, tmp_path=tmp_path)
    assert "Warning" not in quiet.stderr, quiet.stderr
    verbose = run("-m", "cqk_megatron", "--verbose", *params[2:], tmp_path=tmp_path)
    assert all(text in verbose.stderr for text in HIDDEN), verbose.stderr
    assert quiet.stdout == verbose.stdout  # the same answer, less noise


def test_a_rank_started_by_module_name_is_quiet_too(tmp_path):
    train = run(
        "-m", "cqk_megatron.train", "--config", "configs/runs/tiny_cpu.yaml",
        "train.train_steps=1", "train.checkpoint.save_interval=100", f"log.root={tmp_path}",
        tmp_path=tmp_path,
    )  # fmt: skip
    assert "UserWarning" not in train.stderr, train.stderr
