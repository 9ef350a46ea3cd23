"""The GPU figures of a cluster that the step-time model needs, read from the ``hardware:``
block of a cluster profile (``configs/clusters/*.yaml``), torch-free.

    hardware:
      gpu: H100 SXM
      peak_bf16_tflops: 989      # dense, no 2:4 sparsity
      hbm_gib: 79
      hbm_tb_s: 3.35
      intra_node_gb_s: 450       # NVLink, per GPU and direction
      inter_node_gb_s: 50        # the network, per GPU and direction (NDR 400 Gb/s)

The launcher reads the rest of the profile and leaves this block to the planner. Every
bandwidth is one direction's: a ring collective sends and receives at once, so it moves
at the one-way rate (NVLink 4's "900 GB/s per GPU" is both directions together).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cqk_megatron.config import ConfigError, from_dict, read_yaml

HARDWARE_KEY = "hardware"
GB = 1e9


@dataclass(frozen=True)
class ClusterHardware:
    """One GPU kind and its links. Defaults: none; every figure is the profile's."""

    gpu: str
    peak_bf16_tflops: float
    hbm_gib: float
    hbm_tb_s: float
    intra_node_gb_s: float
    inter_node_gb_s: float
    gpus_per_node: int = 8

    @property
    def peak_flops(self) -> float:
        return self.peak_bf16_tflops * 1e12

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gib * 2**30)

    def link_bytes_per_s(self, crosses_nodes: bool) -> float:
        """One direction's bandwidth per GPU of the link a group uses."""
        return (self.inter_node_gb_s if crosses_nodes else self.intra_node_gb_s) * GB


def _positive(hardware: ClusterHardware, source: str) -> ClusterHardware:
    for name in ("peak_bf16_tflops", "hbm_gib", "hbm_tb_s", "intra_node_gb_s", "inter_node_gb_s"):
        if getattr(hardware, name) <= 0:
            raise ConfigError(
                f"{source}: '{HARDWARE_KEY}.{name}' must be positive; write the GPU's figure"
            )
    if hardware.gpus_per_node < 1:
        raise ConfigError(f"{source}: 'gpus_per_node' must be at least 1")
    return hardware


def load_hardware(path: str | Path) -> ClusterHardware:
    """The ``hardware:`` block of cluster profile ``path`` (with the profile's
    ``gpus_per_node``); a profile without one is refused, naming the block to add."""
    data = read_yaml(path, "cluster profile", "see configs/clusters/")
    block = data.get(HARDWARE_KEY)
    if block is None:
        raise ConfigError(
            f"{path}: no '{HARDWARE_KEY}:' block; add the GPU's figures as in "
            "configs/clusters/example_h100.yaml"
        )
    if not isinstance(block, dict):
        raise ConfigError(f"{path}: '{HARDWARE_KEY}' must be a mapping of the GPU's figures")
    values = {**block, "gpus_per_node": data.get("gpus_per_node", 8)}
    return _positive(from_dict(ClusterHardware, values, str(path), f"{HARDWARE_KEY}."), str(path))
