"""Run a function in several CPU processes with gloo on 127.0.0.1 (tests only)."""

from __future__ import annotations

import random
import socket
import time

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 900  # generous for a shared 2-core CI machine; a hang must not stall CI


# Test rendezvous ports: below the kernel's ephemeral range (32768-60999), where gloo's own
# connections take their local ports and could take a port that the OS handed out free a
# moment ago, and below the launcher's range (launch/job.py: 20000-31999), so that tests
# running beside a launched job do not collide with it.
TEST_PORTS = range(10000, 20000)


def free_port() -> int:
    """A port free on 127.0.0.1 now, drawn at random from ``TEST_PORTS`` (test runs in
    parallel rarely draw the same one, and a busy one is skipped)."""
    for port in random.sample(TEST_PORTS, 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port among 200 tried in {TEST_PORTS}")


# Ranks fork from one server process that has imported torch, Megatron and the training
# loop once (importing them costs each spawned rank about 6 CPU-s here), its collector
# paused and then frozen (cqk_megatron/training/preload.py). The server only imports: no
# torch op has run in it, so no thread pool is forked half-initialised. (Python 3.11's
# forkserver imports its preload list before it sets sys.path: only installed modules.)
PRELOAD = ["cqk_megatron.training.preload"]
mp.set_forkserver_preload(PRELOAD)


def run_ranks(fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """``fn(rank, world_size, port, *args)`` in ``world_size`` new processes.

    A failure in any rank raises here with that rank's traceback; ranks still running after
    ``timeout_s`` are killed and a ``TimeoutError`` is raised, so a hang fails the test.
    """
    context = mp.start_processes(
        fn,
        args=(world_size, free_port(), *args),
        nprocs=world_size,
        start_method="forkserver",
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
