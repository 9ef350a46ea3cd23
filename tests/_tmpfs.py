"""A small tmpfs for the tests of a full or read-only disk, mounted as root (mount(8)) and
unmounted after; every mount and umount is bounded in time."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

MOUNT_TIMEOUT_S = 30


def _mount(*args: str) -> subprocess.CompletedProcess:
    command = ["mount", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S)


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's notation, e.g. ``4m``) at ``mount``, made if absent;
    ``read_only`` mounts it so, where even root cannot write."""
    mount.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    out = _mount("-t", "tmpfs", "-o", options, "tmpfs", str(mount))
    assert out.returncode == 0, f"mounting a tmpfs needs root: {out.stderr}"
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True, timeout=MOUNT_TIMEOUT_S)


def remount_read_only(mount: Path) -> None:
    """The tmpfs at ``mount``, with what it holds, read-only from now on."""
    out = _mount("-o", "remount,ro", str(mount))
    assert out.returncode == 0, f"remounting {mount} read-only: {out.stderr}"
