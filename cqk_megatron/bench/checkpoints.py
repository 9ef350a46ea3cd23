"""Checkpoint benchmark (``cqk bench checkpoints [--hidden H --layers L --vocab V]
[--json out.json]``).

Measured, on this machine, in one process: a model of ``--layers`` transformer-sized
blocks (default about 110M parameters: 12 x 768 x 768 x 12 weights plus a 32k x 768
embedding) in bf16 with fp32 master weights and two Adam moments (the 14 bytes a
parameter of a ZeRO-1 checkpoint on one rank), saved the way ``training/checkpoint.py``
and ``training/async_save.py`` save, timed part by part:

- ``staging``: the copy into host memory (``async_save.host_copy``; none when synchronous);
- ``writing``: ``torch.save`` of the weights and the optimizer state to disk (fsync'd);
- ``hashing``: the manifest's digest of every file, ``sha256`` (rank 0, before) and
  ``xxh3_128`` (each rank its own files, now);
- ``manifest``: ``checkpoint_files.write_manifest`` with the digests given;
- ``load``: ``torch.load`` of both files.

"stall" is what training waits for: the whole save when synchronous, the staging when
asynchronous (the write and hashing run in the background).

Estimated (the planner's numbers, not measured): the same split at 1B and 7B on a
cluster, as a fraction of the time between saves at ``configs/runs/1b_4x8.yaml``'s
``save_interval``. See ``cluster_estimate`` for the assumed bandwidths and step times.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from cqk_megatron.perf.memory import model_state_bytes
from cqk_megatron.run import file_hash
from cqk_megatron.run.checkpoint_files import write_manifest
from cqk_megatron.training.async_save import host_copy

# Assumptions of the cluster estimate (stated in the output):
HOST_COPY_GBPS = 20.0  # GPU -> pinned host memory, per GPU (PCIe 5 x16 is ~50 GB/s peak)
WRITE_GBPS_PER_NODE = 2.0  # a node's share of a parallel file system (Lustre/GPFS)
SHA256_GBPS = 1.0  # one core, from docs/checkpoints.md's measurement (1.03 GiB/s)
XXH3_GBPS = 3.0  # one core, from a file (3.00 GiB/s there)
GPUS_PER_NODE = 8
MFU = 0.4  # of H100 bf16 peak (989 TFLOP/s), for the step time
PEAK_FLOPS = 989e12


class ClusterRun(NamedTuple):
    parameters: float
    nodes: int
    tensor_parallel: int
    tokens_per_step: int
    save_interval: int


CLUSTER_RUNS = {
    "1B (configs/runs/1b_4x8.yaml: 4x8 GPUs, TP=1 x DP=32, distributed optimizer)": ClusterRun(
        1.0e9, 4, 1, 512 * 2048, 500
    ),
    "7B (assumed: 8x8 GPUs, TP=2 x DP=32, distributed optimizer, same batch and interval)": (
        ClusterRun(7.0e9, 8, 2, 512 * 2048, 500)
    ),
}


def build_state(hidden: int, layers: int, vocab: int) -> tuple[dict, dict]:
    """(weights, optimizer state) of a GPT-like model: bf16 weights, fp32 master and
    moments, so the bytes a parameter are a bf16 ZeRO-1 checkpoint's on one rank."""
    shapes = {"embedding": (vocab, hidden)}
    for layer in range(layers):
        shapes[f"layer{layer}.qkv"] = (3 * hidden, hidden)
        shapes[f"layer{layer}.proj"] = (hidden, hidden)
        shapes[f"layer{layer}.fc1"] = (4 * hidden, hidden)
        shapes[f"layer{layer}.fc2"] = (hidden, 4 * hidden)
    generator = torch.Generator().manual_seed(0)
    master = {n: torch.randn(s, generator=generator) for n, s in shapes.items()}
    weights = {n: t.to(torch.bfloat16) for n, t in master.items()}
    optimizer = {
        n: {"master": t, "exp_avg": t * 0.1, "exp_avg_sq": t * t} for n, t in master.items()
    }
    return weights, optimizer


def _write(obj, path: Path) -> None:
    torch.save(obj, path)
    with path.open("rb+") as handle:
        os.fsync(handle.fileno())


def time_save(
    folder: Path, weights: dict, optimizer: dict, asynchronous: bool, algorithm: str
) -> dict[str, float]:
    """One save into ``folder``, each part timed (seconds)."""
    times: dict[str, float] = {}
    started = time.perf_counter()
    if asynchronous:
        weights, optimizer = host_copy(weights), host_copy(optimizer)
    times["staging"] = time.perf_counter() - started
    started = time.perf_counter()
    files = {"model.pt": weights, "optimizer.pt": optimizer}
    for name, obj in files.items():
        _write(obj, folder / name)
    times["writing"] = time.perf_counter() - started
    started = time.perf_counter()
    digests = {name: file_hash.file_digest(folder / name, algorithm) for name in files}
    times["hashing"] = time.perf_counter() - started
    started = time.perf_counter()
    write_manifest(folder, 1, True, digests, algorithm=algorithm)
    times["manifest"] = time.perf_counter() - started
    started = time.perf_counter()
    for name in files:
        torch.load(folder / name, weights_only=True)
    times["load"] = time.perf_counter() - started
    save = times["staging"] + times["writing"] + times["hashing"] + times["manifest"]
    times["stall"] = times["staging"] if asynchronous else save
    times["hashing_share"] = times["hashing"] / save
    return times


def measure(hidden: int, layers: int, vocab: int) -> dict:
    weights, optimizer = build_state(hidden, layers, vocab)
    parameters = sum(t.numel() for t in weights.values())
    rows = {}
    for label, asynchronous, algorithm in [
        ("sync, sha256 on rank 0 (before)", False, "sha256"),
        ("sync, xxh3_128 per rank", False, "xxh3_128"),
        ("async, xxh3_128 per rank", True, "xxh3_128"),
    ]:
        with tempfile.TemporaryDirectory() as folder:
            rows[label] = time_save(Path(folder), weights, optimizer, asynchronous, algorithm)
            rows[label]["bytes"] = sum(f.stat().st_size for f in Path(folder).iterdir())
    return {"parameters": parameters, "measured": rows}


def cluster_estimate() -> dict:
    """Per rank, a bf16 checkpoint of Megatron's distributed optimizer (ZeRO-1's bytes are
    the same): the bf16 weights of its TP shard, which the data-parallel ranks of a shard
    write one copy of between them, and its share of the fp32 master and moments
    (``perf.memory.model_state_bytes``)."""
    estimates = {}
    for name, (parameters, nodes, tp, tokens, interval) in CLUSTER_RUNS.items():
        gpus = nodes * GPUS_PER_NODE
        dp = gpus // tp
        state = model_state_bytes(parameters / tp, "bf16", "distopt", dp)
        rank_bytes = state["optimizer"] + state["parameters"] / dp
        total_bytes = rank_bytes * gpus
        step_s = 6 * parameters * tokens / (gpus * PEAK_FLOPS * MFU)
        between_saves = interval * step_s
        parts = {
            "staging": rank_bytes / (HOST_COPY_GBPS * 1e9),
            "writing": total_bytes / (nodes * WRITE_GBPS_PER_NODE * 1e9),
            "hashing sha256 on rank 0 (before)": total_bytes / (SHA256_GBPS * 1e9),
            "hashing xxh3 per rank": rank_bytes / (XXH3_GBPS * 1e9),
            "manifest": 0.1,  # one gather of digests and a small file
        }
        stall = {
            "sync, sha256 on rank 0 (before)": parts["writing"]
            + parts["hashing sha256 on rank 0 (before)"]
            + parts["manifest"],
            "sync, xxh3 per rank": parts["writing"]
            + parts["hashing xxh3 per rank"]
            + parts["manifest"],
            "async, xxh3 per rank": parts["staging"],
        }
        estimates[name] = {
            "checkpoint_GB": total_bytes / 1e9,
            "step_s": step_s,
            "between_saves_s": between_saves,
            "parts_s": parts,
            "stall_s": stall,
            "stall_fraction_of_interval": {k: v / between_saves for k, v in stall.items()},
        }
    return estimates


def report(result: dict) -> str:
    lines = [f"measured on this machine: {result['parameters'] / 1e6:.1f}M parameters (CPU)"]
    lines.append(
        f"  {'save':34s} {'MB':>7s} {'staging':>8s} {'writing':>8s} {'hashing':>8s} "
        f"{'manifest':>8s} {'stall':>7s} {'hash %':>7s} {'load':>7s}"
    )
    for label, t in result["measured"].items():
        lines.append(
            f"  {label:34s} {t['bytes'] / 1e6:7.0f} {t['staging']:8.2f} {t['writing']:8.2f} "
            f"{t['hashing']:8.2f} {t['manifest']:8.3f} {t['stall']:7.2f} "
            f"{100 * t['hashing_share']:6.1f}% {t['load']:7.2f}"
        )
    lines.append(
        f"estimated on a cluster (assumed: host copy {HOST_COPY_GBPS} GB/s a GPU, writes "
        f"{WRITE_GBPS_PER_NODE} GB/s a node, sha256 {SHA256_GBPS} GB/s, xxh3 {XXH3_GBPS} "
        f"GB/s a core, step time at {MFU:.0%} MFU of {PEAK_FLOPS / 1e12:.0f} TFLOP/s):"
    )
    for name, e in result["cluster"].items():
        lines.append(
            f"  {name}: {e['checkpoint_GB']:.0f} GB a save, a save every "
            f"{e['between_saves_s']:.0f} s"
        )
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in e["parts_s"].items())
        lines.append(f"    parts: {parts}")
        for label, stall in e["stall_s"].items():
            fraction = e["stall_fraction_of_interval"][label]
            lines.append(f"    {label:34s} stall {stall:6.1f} s = {100 * fraction:5.2f}%")
    return "\n".join(lines)
