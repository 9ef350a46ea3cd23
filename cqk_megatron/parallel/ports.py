"""The rendezvous-port rule, in one place (torch-free: the launcher derives a job's port
without Megatron; ``cqk_megatron.parallel.process_groups`` and ``launch/job.py`` both read it here).

Rendezvous ports stay below Linux's default ephemeral range (32768-60999): there the
kernel hands out ports to outgoing connections and to gloo's own listeners, and a derived
port that one of them held made rank 0 fail with EADDRINUSE while rank 1 waited.

- A Slurm job's tasks each derive the same port from the job id alone
  (``rendezvous_port``): no communication needed, and distinct jobs (array tasks have
  their own numeric ``SLURM_JOB_ID``) get distinct ports.
- A process that rendezvouses on one machine (a plain ``cqk train``, a repro run through
  ``torch.distributed.run``) takes a port that is free now (``free_port``), so two of them
  on one machine do not collide.
"""

from __future__ import annotations

import random
import socket

PORT_BASE, PORT_SPAN = 20000, 12000
RENDEZVOUS_PORTS = range(PORT_BASE, PORT_BASE + PORT_SPAN)


def rendezvous_port(job_id: str | int) -> int:
    """The port every task of job ``job_id`` derives (its digits, folded into the range)."""
    digits = "".join(ch for ch in str(job_id) if ch.isdigit()) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` now, drawn at random from ``RENDEZVOUS_PORTS``."""
    for port in random.sample(RENDEZVOUS_PORTS, 200):
        if port_is_free(port, host):
            return port
    raise RuntimeError(
        f"no free port among 200 tried in {RENDEZVOUS_PORTS.start}-{RENDEZVOUS_PORTS.stop - 1}"
    )
