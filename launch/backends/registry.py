"""Launch backends by name: ``--cluster NAME`` (or a profile's ``cluster:``) picks one.

    from launch.backends import Backend, register_backend
    register_backend("mine", MyBackend)       # then: launch/submit.py --cluster mine ...

The two that ship are named here by import path and imported on first use: this module
stays free of submitit and the executors, so that ``launch.resources`` (which the
executors import) can check a profile's ``cluster:`` against the same names.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator

from cqk_megatron.config import ConfigError
from launch.backends.base import Backend

SLURM = "slurm"  # a Slurm cluster (launch/backends/slurm.py)
LOCAL = "local"  # this machine, no scheduler (launch/backends/local.py)
_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")
# name: the class, or "module:Class" until it is first asked for
_BACKENDS: dict[str, type[Backend] | str] = {
    SLURM: "launch.backends.slurm:SlurmBackend",
    LOCAL: "launch.backends.local:LocalBackend",
}


def register_backend(name: str, cls: type[Backend]) -> None:
    """Make ``cls`` the backend called ``name`` (a new name, or the same class again)."""
    if not _NAME.match(name):
        raise ValueError(f"backend name {name!r}: lower-case letters, digits, '-' and '_'")
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"backend {name!r}: {cls!r} is not a launch.backends.Backend subclass")
    known = _BACKENDS.get(name)
    if known is not None and known is not cls:
        raise ValueError(f"backend {name!r} is already registered ({_describe(known)})")
    _BACKENDS[name] = cls


def backend_names() -> list[str]:
    return list(_BACKENDS)


def get_backend(name: str) -> Backend:
    """A new instance of the backend called ``name``; ``ConfigError`` listing the known
    names if there is none."""
    entry = _BACKENDS.get(name)
    if entry is None:
        raise ConfigError(
            f"--cluster {name!r} is not a launch backend; known: {', '.join(_BACKENDS)} "
            "(a new one is registered with launch.backends.register_backend)"
        )
    if isinstance(entry, str):
        module, _, attribute = entry.partition(":")
        entry = _BACKENDS[name] = getattr(importlib.import_module(module), attribute)
    return entry(name)


def _describe(entry: type[Backend] | str) -> str:
    return entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"


class _Names:
    """The registered names as they are at each use (a backend may be registered after
    import): ``name in BACKEND_NAMES``, ``list(BACKEND_NAMES)``."""

    def __contains__(self, name: object) -> bool:
        return name in _BACKENDS

    def __iter__(self) -> Iterator[str]:
        return iter(list(_BACKENDS))

    def __len__(self) -> int:
        return len(_BACKENDS)


BACKEND_NAMES = _Names()
