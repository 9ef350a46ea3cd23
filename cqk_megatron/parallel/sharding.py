"""Where a tensor of the full (TP=1, PP=1) model lives under a TP x PP layout.

Used to start every layout from the same weights (tests), and by conversion code that
gathers or scatters whole tensors. Rules: a pipeline stage numbers its layers from 0,
so ``decoder.layers.i`` on stage ``s`` is global layer ``i + s * layers_per_stage``;
a tensor-parallel parameter (``param.tensor_model_parallel``) is split into contiguous
chunks along ``param.partition_dim``, except SwiGLU's fused ``linear_fc1``, whose gate
and up halves are split separately (each rank holds ``[gate_r; up_r]``).
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"^(?P<head>(.*\.)?decoder\.layers\.)(?P<index>\d+)(?P<tail>\..*)$")


def global_name(local_name: str, layer_offset: int) -> str:
    """The full model's name of a parameter named ``local_name`` on a pipeline stage."""
    match = _LAYER.match(local_name)
    if match is None:
        return local_name
    index = int(match["index"]) + layer_offset
    return f"{match['head']}{index}{match['tail']}"


def is_gated_fc1(name: str, gated: bool) -> bool:
    return gated and name.endswith("mlp.linear_fc1.weight")


def local_shard(
    full: torch.Tensor,
    param: torch.Tensor,
    name: str,
    tp_rank: int,
    tp_size: int,
    gated_linear_unit: bool,
) -> torch.Tensor:
    """This TP rank's part of ``full`` for the local parameter ``param``."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if is_gated_fc1(name, gated_linear_unit):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp_size, dim)[tp_rank], up.chunk(tp_size, dim)[tp_rank]], dim)
    return full.chunk(tp_size, dim=dim)[tp_rank]


@torch.no_grad()
def load_full_state(
    model: torch.nn.Module,
    full_state: dict[str, torch.Tensor],
    layer_offset: int,
    tp_rank: int,
    tp_size: int,
    gated_linear_unit: bool,
) -> None:
    """Copy the full model's parameters into this rank's (sharded, staged) model."""
    for name, param in model.named_parameters():
        full = full_state[global_name(name, layer_offset)]
        param.copy_(local_shard(full, param, name, tp_rank, tp_size, gated_linear_unit))
