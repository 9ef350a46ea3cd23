"""pytest's set-up for the whole repository.

A root conftest: pytest puts this folder first on ``sys.path``, so the tests import this
checkout's ``cqk_megatron`` (as ``PYTHONPATH=$PWD`` does for the processes they start);
``tests/`` is on it too, for the helpers the tests share (``_tiny``, the model every test
builds small; ``_multiproc``; ``_equivalence``; ...).
"""

from __future__ import annotations

import os

import pytest

from cqk_megatron.parallel.device import device

# DeepSpeed picks its accelerator when it is first imported: the one of this process's
# device, as training does (training/engines/deepspeed.py), unless the caller names one
# (.ci/run: cpu).
os.environ.setdefault("DS_ACCELERATOR", device().type)


@pytest.fixture(autouse=True, scope="session")
def _private_state_home(tmp_path_factory):
    """The launcher notes the runs it submits in ``$XDG_STATE_HOME`` (launch/run_dir.py,
    ``runs_index``): the tests' launchers, whose environment is this one, note theirs in
    a folder of this session, not in the home of whoever runs the tests."""
    before = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if before is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = before
