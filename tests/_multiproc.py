"""Run a function in several CPU processes with gloo on 127.0.0.1 (tests only)."""

from __future__ import annotations

import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(fn, world_size: int, *args) -> None:
    """``fn(rank, world_size, port, *args)`` in ``world_size`` spawned processes.

    A failure in any rank raises here with that rank's traceback.
    """
    mp.start_processes(
        fn, args=(world_size, free_port(), *args), nprocs=world_size, start_method="spawn"
    )
