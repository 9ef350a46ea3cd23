"""Record every ``torch.distributed`` collective that this package's code calls (tests only).

``install`` wraps each communicating function of ``torch.distributed`` (the list is
``collectives.COMMUNICATING``). A call whose immediate caller is a module of
``cqk_megatron`` is counted under (caller file, function, devices of its tensors);
Megatron's and DeepSpeed's own collectives (their callers are theirs) pass uncounted.
Code that looks the function up at call time (``dist.all_reduce(...)``, as this package
does) goes through the wrapper.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

import cqk_megatron
from cqk_megatron.training.collectives import COMMUNICATING

PACKAGE = Path(cqk_megatron.__file__).resolve().parent
REPO = PACKAGE.parent


def _devices(values) -> set[str]:
    found = set()
    for value in values:
        if isinstance(value, torch.Tensor):
            found.add(str(value.device))
        elif isinstance(value, (list, tuple)):
            found |= _devices(value)
    return found


def install(counts: Counter) -> None:
    """Count into ``counts`` every package call of a communicating collective."""
    for name in sorted(COMMUNICATING):
        original = getattr(dist, name, None)
        if original is None or hasattr(original, "_audited"):
            continue

        def audited(*args, _name=name, _original=original, **kwargs):
            caller = Path(sys._getframe(1).f_code.co_filename).resolve()
            if caller.is_relative_to(PACKAGE):
                devices = ",".join(sorted(_devices([*args, *kwargs.values()]))) or "-"
                counts[(caller.relative_to(REPO).as_posix(), _name, devices)] += 1
            return _original(*args, **kwargs)

        audited._audited = True
        setattr(dist, name, audited)
