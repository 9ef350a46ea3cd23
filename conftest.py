"""pytest's set-up for the whole repository.

A root conftest: pytest puts this folder first on ``sys.path``, so the tests import this
checkout's ``cqk_megatron`` (as ``PYTHONPATH=$PWD`` does for the processes they start);
``tests/`` is on it too, for the helpers the tests share (``_tiny``, the model every test
builds small; ``_multiproc``; ``_equivalence``; ...).
"""

from __future__ import annotations

import os

from cqk_megatron.parallel.device import device

# DeepSpeed picks its accelerator when it is first imported: the one of this process's
# device, as training does (deepspeed_engine), unless the caller names one (.ci/run: cpu).
os.environ.setdefault("DS_ACCELERATOR", device().type)
