"""One file's SHA-256, read in 1 MiB blocks (checkpoint manifests, dataset fingerprints,
the demo corpus's completeness record). Torch-free."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
