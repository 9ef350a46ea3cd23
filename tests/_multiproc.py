"""Run a function in several CPU processes with gloo on 127.0.0.1 (tests only)."""

from __future__ import annotations

import socket
import time

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 900  # generous for a shared 2-core CI machine; a hang must not stall CI


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """``fn(rank, world_size, port, *args)`` in ``world_size`` spawned processes.

    A failure in any rank raises here with that rank's traceback; ranks still running after
    ``timeout_s`` are killed and a ``TimeoutError`` is raised, so a hang fails the test.
    """
    context = mp.start_processes(
        fn,
        args=(world_size, free_port(), *args),
        nprocs=world_size,
        start_method="spawn",
        join=False,
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(
                f"{fn.__name__} on {world_size} ranks still running after {timeout_s} s"
            )
