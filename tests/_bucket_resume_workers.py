"""Ranks for tests/test_bucket_resume.py: the command line's training entry on the
Megatron engine, with the gradient bucket of ``overlap_grad_reduce`` set by the test
(tests only: the engine derives it from the model; ``bucket`` None keeps that)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from _training import config_for, set_rank_env


def train_with_bucket(rank, world_size, port, root, name, overrides, bucket, resume) -> None:
    """``cqk train``'s entry (``cqk_megatron.train._train``: a refusal is one line and exit
    2) with each chunk's bucket ``bucket`` elements and ``--resume resume``; rank 0
    appends the exit code to ``root/name.exit`` and writes what it printed to
    ``root/name.err``."""
    set_rank_env(rank, world_size, port)
    from cqk_megatron import train as command
    from cqk_megatron.training.engines import megatron as megatron_engine

    if bucket is not None:
        megatron_engine.bucket_elements = lambda chunk: bucket
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = command._train(config_for(root, name, overrides), resume)
    if rank == 0:
        with Path(root, f"{name}.exit").open("a") as handle:
            handle.write(f"{code}\n")
        Path(root, f"{name}.err").write_text(err.getvalue())
