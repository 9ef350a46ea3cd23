"""Rank and world discovery, the process group, and Megatron's ``parallel_state``.

Works under torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/
``MASTER_PORT``), plain ``srun`` (``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``
and the first node of ``SLURM_JOB_NODELIST``) and submitit (which sets the Slurm
variables too). The default process group is NCCL on GPU and gloo on CPU (why not both
libraries at once: ``cqk_megatron.training.collectives``), and the rank's GPU is bound
(``cqk_megatron.parallel.device.bind``) before it is created. A single process started without any
of these (a plain ``cqk train``) rendezvouses on a port that is free now (the port rule:
``cqk_megatron.parallel.ports``), so two of them on
one machine do not collide; a port already taken is reported with how to choose another.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cqk_megatron.compat import cpu_bridge, megatron_state
from cqk_megatron.config import RunConfig
from cqk_megatron.parallel.device import bind
from cqk_megatron.parallel.ports import free_port, rendezvous_port
from cqk_megatron.training.engines import engine_of


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
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=int(env["SLURM_NTASKS"]),
            master_addr=env.get("MASTER_ADDR")
            or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            master_port=int(env.get("MASTER_PORT") or rendezvous_port(env.get("SLURM_JOB_ID", ""))),
        )
    port = env.get("MASTER_PORT")
    return DistEnv(0, 0, 1, "127.0.0.1", int(port) if port else free_port())


def _port_in_use(error: Exception) -> bool:
    text = str(error)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


class RendezvousError(RuntimeError):
    """Not every rank arrived at rendezvous within ``train.resilience.init_timeout_s``."""


class PortInUseError(RuntimeError):
    """The rendezvous port is taken on this host: a set-up error, not a lost rank."""


def _port_in_use_message(dist_env: DistEnv) -> str:
    return (
        f"rendezvous port {dist_env.master_port} on {dist_env.master_addr} is already "
        "in use (another job on this machine?); set MASTER_PORT to a free port, e.g. "
        f"MASTER_PORT={free_port()} (torchrun: --master-port), or leave it unset for a "
        "single process to pick one"
    )


def collective_library() -> str:
    """The default group's collective library (torch's process-group "backend"): ``nccl``
    where CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(dist_env: DistEnv | None = None, timeout_s: float | None = None) -> DistEnv:
    """Start the default process group (NCCL on GPU, gloo on CPU), once.

    ``timeout_s`` bounds the rendezvous and every collective until
    ``set_collective_timeout`` lowers it (None: torch's defaults, 30 min for gloo and
    10 min for NCCL, and no roll call)."""
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
        library = collective_library()
        if library == "nccl":
            nccl_error_handling(dist_env.rank)
        try:
            if timeout_s is None:
                dist.init_process_group(
                    backend=library,
                    init_method=f"tcp://{dist_env.master_addr}:{dist_env.master_port}",
                    rank=dist_env.rank,
                    world_size=dist_env.world_size,
                )
            else:
                store = rendezvous(dist_env, timeout_s)
                dist.init_process_group(
                    backend=library,
                    store=store,
                    rank=dist_env.rank,
                    world_size=dist_env.world_size,
                    timeout=timedelta(seconds=timeout_s),
                )
        except RuntimeError as error:
            if isinstance(error, (RendezvousError, PortInUseError)) or not _port_in_use(error):
                raise
            raise PortInUseError(_port_in_use_message(dist_env)) from error
    return dist_env


# -- faults: bounded rendezvous and collectives -------------------------------------------


def nccl_error_handling(rank: int) -> None:
    """A timed-out NCCL collective must end the process, not hang it.

    torch 2.11 and 2.13 read ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` when a NCCL group is made;
    unset, it means 3 (tear the process down without aborting communicators first), as
    torchtitan also sets it; 1 aborts the communicators, then tears down. 0 (no handling)
    and 2 (abort only, keep running) leave a timed-out collective to hang, so they are
    named here. Set explicitly so that a site's environment cannot drop it silently."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    value = os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    if value not in ("1", "3") and rank == 0:
        print(
            f"warning: TORCH_NCCL_ASYNC_ERROR_HANDLING={value} lets a timed-out NCCL "
            "collective hang instead of ending the process; unset it or use 1 or 3",
            flush=True,
        )


def _uses_agent_store() -> bool:
    """Under torchrun the agent hosts the store at MASTER_ADDR:MASTER_PORT (torch's own
    ``_torchelastic_use_agent_store``): every rank is a client of it."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def rendezvous(dist_env: DistEnv, timeout_s: float) -> dist.Store:
    """The job's TCPStore, with a roll call: every rank signs in with its host and PID,
    and a rank missing after ``timeout_s`` is named (torch's own rendezvous only counts
    clients, and waits 30 minutes by default)."""
    where = f"{dist_env.master_addr}:{dist_env.master_port}"
    started = time.monotonic()
    host = dist_env.rank == 0 and not _uses_agent_store()
    try:
        if not host:  # torch's client retries for up to twice its timeout: wait here instead
            _wait_until_listening(dist_env.master_addr, dist_env.master_port, timeout_s)
        store = dist.TCPStore(
            dist_env.master_addr,
            dist_env.master_port,
            dist_env.world_size,
            is_master=host,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            multi_tenant=host,
        )
    except (RuntimeError, OSError) as error:  # DistNetworkError, EADDRINUSE
        if host and _port_in_use(error):  # a set-up error: say how to choose another port
            raise PortInUseError(_port_in_use_message(dist_env)) from error
        who = "the rendezvous host" if not host else "this rank, the rendezvous host,"
        raise RendezvousError(
            f"rank {dist_env.rank} on {socket.gethostname()}: {who} at {where} could not be "
            f"reached or started within {time.monotonic() - started:.0f} s "
            f"(train.resilience.init_timeout_s={timeout_s:g}): rank 0 never arrived, or the "
            f"address is wrong ({str(error).splitlines()[0]})"
        ) from error
    if dist_env.world_size == 1:
        return store
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's agent store
    keys = [f"cqk/roll-call/{restart}/{r}" for r in range(dist_env.world_size)]
    me = {"host": socket.gethostname(), "pid": os.getpid()}
    store.set(keys[dist_env.rank], json.dumps(me))
    left = max(timeout_s - (time.monotonic() - started), 0.1)
    try:
        store.wait(keys, timedelta(seconds=left))
    except (RuntimeError, OSError) as error:  # DistStoreError: timed out
        try:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
        except (RuntimeError, OSError):
            missing = []
        named = f"rank{'s' if len(missing) != 1 else ''} {', '.join(map(str, missing))}"
        raise RendezvousError(
            f"rank {dist_env.rank} on {me['host']}: {named or 'some rank'} never arrived at "
            f"rendezvous {where} within {time.monotonic() - started:.0f} s "
            f"(train.resilience.init_timeout_s={timeout_s:g}); "
            f"{dist_env.world_size - len(missing)} of {dist_env.world_size} signed in"
        ) from error
    return store


def _wait_until_listening(addr: str, port: int, timeout_s: float) -> None:
    """Until something accepts connections at ``addr:port``; OSError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(left, 2.0))):
                return
        except OSError as error:
            if time.monotonic() + 0.25 >= deadline:
                raise OSError(f"nothing listens at {addr}:{port}: {error}") from error
            time.sleep(0.25)


def set_collective_timeout(seconds: float) -> None:
    """Every process group of this rank (the default one, Megatron's, DeepSpeed's) times
    its collectives out after ``seconds`` from now on (torchtitan lowers its init timeout
    the same way, with ``_set_pg_timeout`` on each group). Local: no communication, so
    callers that lower it agree first (a barrier) that start-up is over everywhere."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=seconds)
    for group in list(c10d._world.pg_map):  # private, torch is pinned
        try:
            c10d._set_pg_timeout(timeout, group)
        except (ValueError, RuntimeError, AssertionError):
            continue  # a group on neither gloo nor NCCL (none here); nothing to bound


def init_model_parallel(config: RunConfig) -> None:
    """(Re)build Megatron's tensor/pipeline/data-parallel groups for ``config``, and seed
    the CUDA RNG tracker that goes with them (``config.seed``; the training loop seeds it
    again per pipeline stage)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    megatron_state.forget_embedding_ranks()  # what destroy_model_parallel leaves behind
    _destroy_megatron_groups()
    p = config.parallel
    before = set(_all_groups())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_parallel,
        pipeline_model_parallel_size=p.pipeline_parallel,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline,
        # Megatron gives each of its groups this timeout (whole minutes), not the default
        # group's: start-up's bound, until set_collective_timeout lowers every group's.
        distributed_timeout_minutes=max(1, math.ceil(config.train.resilience.init_timeout_s / 60)),
        # Megatron's gloo twins of its groups (data parallel with and without context
        # parallelism, expert data parallel, ...): only Megatron's distributed optimizer uses
        # them (its checkpoint formats). Elsewhere they are a TCP rendezvous and a set of
        # host connections per group at start-up, across nodes, for nothing.
        create_gloo_process_groups=engine_of(config).gloo_groups,
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
    in one process (parameter counter, conversion, MQAR, benchmark): the same collective
    library, device and seeded CUDA RNG tracker (which Megatron's layers initialise their weights
    under on GPU) as training."""
    config = config or RunConfig()
    if not dist.is_initialized():
        bind()
        cpu_bridge.install()
        dist.init_process_group(collective_library(), store=dist.HashStore(), rank=0, world_size=1)
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
