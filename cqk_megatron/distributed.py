"""Rank and world discovery, the process group, and Megatron's ``parallel_state``.

Works under torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/
``MASTER_PORT``), plain ``srun`` (``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``
and the first node of ``SLURM_JOB_NODELIST``) and submitit (which sets the Slurm
variables too). The default process group is NCCL on GPU and gloo on CPU (why not both
backends at once: ``cqk_megatron.training.collectives``), and the rank's GPU is bound
(``cqk_megatron.device.bind``) before it is created. A single process started without any
of these (a plain ``cqk-train``) rendezvouses on a port that is free now, so two of them on
one machine do not collide; a port already taken is reported with how to choose another.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cqk_megatron import cpu_bridge
from cqk_megatron.config import RunConfig
from cqk_megatron.device import bind


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int


def _first_slurm_host(nodelist: str) -> str:
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        )
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        # "node[01-04],x" -> "node01" without scontrol
        head = nodelist.split(",")[0]
        if "[" in head:
            prefix, rest = head.split("[", 1)
            return prefix + rest.split("-")[0].split(",")[0].rstrip("]")
        return head


def discover(env: dict[str, str] | None = None) -> DistEnv:
    """Rank, world and rendezvous address from the launcher's environment."""
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, or set explicitly
        return DistEnv(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env["WORLD_SIZE"]),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:  # srun, submitit
        job_id = int(env.get("SLURM_JOB_ID", "0") or 0)
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=int(env["SLURM_NTASKS"]),
            master_addr=env.get("MASTER_ADDR")
            or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            # launch/job.py's rendezvous_port: below the kernel's ephemeral port range
            master_port=int(env.get("MASTER_PORT", 20000 + job_id % 12000)),
        )
    port = env.get("MASTER_PORT")
    return DistEnv(0, 0, 1, "127.0.0.1", int(port) if port else free_port())


# Below Linux's ephemeral range (32768-60999), where gloo's own sockets take their ports:
# the range launch/job.py's rendezvous ports come from.
PORTS = range(20000, 32000)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` now, drawn at random from ``PORTS``."""
    for port in random.sample(PORTS, 200):
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port among 200 tried in {PORTS.start}-{PORTS.stop - 1}")


def _port_in_use(error: Exception) -> bool:
    text = str(error)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def backend() -> str:
    """The default group's backend: ``nccl`` where CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(dist_env: DistEnv | None = None) -> DistEnv:
    """Start the default process group (NCCL on GPU, gloo on CPU), once."""
    dist_env = dist_env or discover()
    # DeepSpeed reads these from the environment whatever launched us (srun sets none).
    for name, value in (
        ("RANK", dist_env.rank),
        ("LOCAL_RANK", dist_env.local_rank),
        ("WORLD_SIZE", dist_env.world_size),
        ("MASTER_ADDR", dist_env.master_addr),
        ("MASTER_PORT", dist_env.master_port),
    ):
        os.environ.setdefault(name, str(value))
    bind()  # cuda:LOCAL_RANK, read from the variables just set (no-op on CPU)
    cpu_bridge.install()  # no-op with CUDA
    if not dist.is_initialized():
        try:
            dist.init_process_group(
                backend=backend(),
                init_method=f"tcp://{dist_env.master_addr}:{dist_env.master_port}",
                rank=dist_env.rank,
                world_size=dist_env.world_size,
            )
        except RuntimeError as error:
            if not _port_in_use(error):
                raise
            raise RuntimeError(
                f"rendezvous port {dist_env.master_port} on {dist_env.master_addr} is already "
                "in use (another job on this machine?); set MASTER_PORT to a free port, e.g. "
                f"MASTER_PORT={free_port()} (torchrun: --master-port), or leave it unset for a "
                "single process to pick one"
            ) from error
    return dist_env


def init_model_parallel(config: RunConfig) -> None:
    """(Re)build Megatron's tensor/pipeline/data-parallel groups for ``config``, and seed
    the CUDA RNG tracker that goes with them (``config.seed``; the training loop seeds it
    again per pipeline stage)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _destroy_megatron_groups()
    p = config.parallel
    before = set(_all_groups())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_parallel,
        pipeline_model_parallel_size=p.pipeline_parallel,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline,
    )
    _megatron_groups.extend(g for g in _all_groups() if g not in before)
    seed_cuda_rng_tracker(config.seed)


# The groups the last init_model_parallel made. Megatron's destroy_model_parallel only
# forgets its groups: torch keeps each one (for gloo, a context with three threads) until
# destroy_process_group, so every rebuild in one process (the tools that count parameters
# or convert, the tests) leaked ~20 groups: a test session grew to ~3,000 gloo threads.
_megatron_groups: list[dist.ProcessGroup] = []


def _all_groups() -> list[dist.ProcessGroup]:
    return list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []


def _destroy_megatron_groups() -> None:
    """Destroy (locally: no collective) the groups the last init_model_parallel made."""
    alive = set(_all_groups())
    while _megatron_groups:
        group = _megatron_groups.pop()
        if group in alive:
            dist.destroy_process_group(group)


def init_single_process(config: RunConfig | None = None) -> None:
    """A world of one (no network) with TP=PP=1 groups, for the tools that build a model
    in one process (parameter counter, conversion, MQAR, benchmark): the same backend,
    device and seeded CUDA RNG tracker (which Megatron's layers initialise their weights
    under on GPU) as training."""
    config = config or RunConfig()
    if not dist.is_initialized():
        bind()
        cpu_bridge.install()
        dist.init_process_group(backend(), store=dist.HashStore(), rank=0, world_size=1)
    init_model_parallel(config)


def seed_cuda_rng_tracker(seed: int) -> None:
    """Seed Megatron's CUDA RNG tracker, which its layers initialise their weights under on
    GPU and which sequence parallelism and recompute swap states of. On CPU (through the
    CPU bridge) its states are CPU-generator states, and seeding it leaves the CPU
    generator as it was."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed)
        return
    cpu_bridge.install()
    state = torch.get_rng_state()
    model_parallel_cuda_manual_seed(seed)
    torch.set_rng_state(state)
