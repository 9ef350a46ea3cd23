"""Override lists for the tests' command lines.

A command line that gives one key twice is refused (``config.load.refuse_repeated_overrides``),
as a user's would be, so a test that changes a key of its base list replaces it rather than
appending a second value.
"""

from __future__ import annotations


def _keys(override: str) -> list[str]:
    return override.split("=", 1)[0].strip().split(".")


def _overlap(first: str, second: str) -> bool:
    """Whether the two set one key (or one sets a section that holds the other's key)."""
    a, b = _keys(first), _keys(second)
    common = min(len(a), len(b))
    return a[:common] == b[:common]


def replaced(base: list[str], *changes: str) -> list[str]:
    """``base`` less the overrides whose keys ``changes`` set, then ``changes``."""
    kept = [o for o in base if not any(_overlap(o, change) for change in changes)]
    return [*kept, *changes]
