"""Atomic writes: the file appears whole or not at all, readable by the team (umask)."""

from __future__ import annotations

import os
import stat

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from cqk_megatron.analysis.plots import save  # noqa: E402
from cqk_megatron.run.atomic import atomic_path, write_text_atomically  # noqa: E402


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_get_the_umask_permissions_not_0600(tmp_path, umask_022):
    write_text_atomically(tmp_path / "a" / "report.md", "# report\n")
    write_text_atomically(tmp_path / "config.yaml", "name: x\n")
    figure, _ = plt.subplots()
    save(figure, tmp_path / "figures" / "loss.png")
    for path in (tmp_path / "a" / "report.md", tmp_path / "config.yaml"):
        assert mode(path) == 0o644, oct(mode(path))
    assert mode(tmp_path / "figures" / "loss.png") == 0o644
    assert (tmp_path / "figures" / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_an_error_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "metrics.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("crash while writing")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]
