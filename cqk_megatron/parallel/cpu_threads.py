"""How many threads torch uses on a CPU rank: the cores it may run on, shared by the ranks
of its node.

torch's default is one thread per core of the machine in every process, so four ranks on
a 2-core machine run eight busy threads on two cores and spend their time switching (a
step of ``configs/runs/tiny_cpu.yaml`` costs about 9x the CPU time of one thread, on a
loaded machine). The cores a process may use are its CPU affinity (``taskset``, a cgroup
cpuset, Slurm's binding), not ``os.cpu_count()``; the ranks on its node are
``LOCAL_WORLD_SIZE`` (torchrun) or ``SLURM_NTASKS_PER_NODE`` (srun). ``OMP_NUM_THREADS``,
where set (by the user, torchrun or the launcher), wins: torch has already read it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadChoice:
    """``threads`` for torch and where the number comes from, in words."""

    threads: int
    why: str

    def line(self) -> str:
        return f"torch threads per rank: {self.threads} ({self.why})"


def usable_cores() -> int:
    """The cores this process may run on (its affinity; the machine's where that is not
    known)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def ranks_on_node(env: Mapping[str, str]) -> int:
    """The processes of this job on this node (1 for a plain process)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def choose_threads(env: Mapping[str, str], cores: int) -> ThreadChoice:
    """The thread count for a CPU rank: ``OMP_NUM_THREADS`` where it is a number, else the
    usable cores shared evenly by the node's ranks (at least one)."""
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return ThreadChoice(int(given), "OMP_NUM_THREADS is set")
    ranks = ranks_on_node(env)
    threads = max(1, cores // ranks)
    return ThreadChoice(threads, f"{cores} usable cores / {ranks} rank(s) on this node")


def set_cpu_threads(env: Mapping[str, str] | None = None) -> ThreadChoice:
    """Choose the thread count and give it to torch (a CPU run only calls this)."""
    import torch

    choice = choose_threads(os.environ if env is None else env, usable_cores())
    torch.set_num_threads(choice.threads)
    return ThreadChoice(torch.get_num_threads(), choice.why)  # what torch took
