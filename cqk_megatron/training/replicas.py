"""Replica checks: every parameter that must be the same on several ranks is, bit for bit.

Megatron-LM's ``--check-weight-hash-across-dp-replicas-interval`` (its
``check_param_hashes_across_dp_replicas``) compares data-parallel replicas; a layout here
keeps three kinds of copies, and ``train.resilience.check_replicas_interval`` compares all three:

- **data-parallel replicas**: every parameter, across the data-parallel group. Under
  DeepSpeed ZeRO-3 a parameter has no replicas there (each data-parallel rank holds another
  partition of its one copy), so nothing is compared across that group, and the run says so;
- **tensor-parallel replicas**: every parameter that tensor parallelism does not split
  (``tensor_model_parallel`` unset: the coupling's ``f`` and ``dt``, the differential
  ``lambda`` and RMSNorm, the norms, row-parallel biases, learned positions), across the
  tensor-parallel group; under ZeRO-3 the partition each rank holds (the tensor-parallel
  ranks at one data-parallel rank hold the same partition of a replicated parameter);
- **tied embeddings under pipeline parallelism**: the first stage's word embedding and the
  last stage's output layer, across Megatron's embedding group.

Each tensor's bytes are hashed (sha256) on the host, as Megatron-LM does; only the digests
travel, all-gathered on the device through ``collectives``. The copy to the host is why the
check runs every so many steps rather than every step. A difference stops every rank with
the same ``ReplicaMismatch``, naming the step, the first parameter (its name in the full
model: layers numbered across pipeline stages) and which ranks hold which value.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from cqk_megatron.config import RunConfig
from cqk_megatron.model.gpt import model_chunks
from cqk_megatron.parallel.device import to_device
from cqk_megatron.parallel.sharding import global_name
from cqk_megatron.training import collectives
from cqk_megatron.training.engines import engine_of

DIGEST_WORDS = 4  # a sha256 as four int64


class ReplicaMismatch(RuntimeError):
    """Copies of a parameter that must be identical differ between ranks."""


@dataclass(frozen=True)
class _Comparison:
    """One group of ranks that must hold the same tensors, in the same order."""

    what: str  # which copies, for the message
    group: dist.ProcessGroup
    names: list[str]
    params: list[torch.nn.Parameter]


def held_tensor(param: torch.nn.Parameter) -> torch.Tensor:
    """What this rank holds of ``param``: the whole of it, or under ZeRO-3 its partition."""
    partition = getattr(param, "ds_tensor", None)
    return param.data if partition is None else partition.data


def digest(tensor: torch.Tensor) -> torch.Tensor:
    """sha256 of ``tensor``'s bytes, as ``DIGEST_WORDS`` int64 on the host."""
    raw = tensor.detach().reshape(-1).contiguous().view(torch.uint8).cpu()
    return torch.frombuffer(bytearray(hashlib.sha256(raw.numpy()).digest()), dtype=torch.int64)


def named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """This rank's parameters under their full-model names (a chunk's layers numbered as
    in the whole model: ``layer_number`` is global and 1-based)."""
    named = []
    for chunk in model_chunks(model):
        layers = chunk.decoder.layers
        offset = layers[0].layer_number - 1 if len(layers) else 0
        named += [(global_name(name, offset), p) for name, p in chunk.named_parameters()]
    return named


def partitions_parameters(config: RunConfig) -> bool:
    """Whether the engine keeps a partition of each parameter on each data-parallel rank
    (ZeRO-3): its data-parallel replicas are then not whole parameters to compare."""
    return engine_of(config).partitions_parameters(config)


def _tied_embedding(model: torch.nn.Module) -> torch.nn.Parameter:
    """The first stage's word embedding, or the last stage's copy of it (its output layer)."""
    for chunk in model_chunks(model):
        if chunk.pre_process or chunk.post_process:
            return chunk.shared_embedding_or_output_weight()
    raise AssertionError("a rank of the embedding group holds neither end of the model")


def comparisons(model: torch.nn.Module, config: RunConfig) -> list[_Comparison]:
    """The groups this rank compares, in the same order on every rank (so that no two
    ranks wait on each other's group)."""
    named = named_parameters(model)
    found = []
    if ps.get_data_parallel_world_size() > 1 and not partitions_parameters(config):
        names, params = zip(*named, strict=True)
        found.append(
            _Comparison(
                "data-parallel replicas", ps.get_data_parallel_group(), list(names), list(params)
            )
        )
    if ps.get_tensor_model_parallel_world_size() > 1:
        replicated = [(n, p) for n, p in named if not getattr(p, "tensor_model_parallel", False)]
        names, params = zip(*replicated, strict=True) if replicated else ((), ())
        found.append(
            _Comparison(
                "tensor-parallel replicas: parameters whole on every tensor-parallel rank",
                ps.get_tensor_model_parallel_group(),
                list(names),
                list(params),
            )
        )
    if _ties_across_stages(config) and ps.is_rank_in_embedding_group():
        found.append(
            _Comparison(
                "tied embedding copies: the first stage's word embedding, the last stage's "
                "output_layer.weight",
                ps.get_embedding_group(),
                ["embedding.word_embeddings.weight"],
                [_tied_embedding(model)],
            )
        )
    return found


def _ties_across_stages(config: RunConfig) -> bool:
    return config.model.tie_embeddings and config.parallel.pipeline_parallel > 1


def anything_to_compare(config: RunConfig) -> bool:
    """Whether the layout keeps copies on several ranks (the same answer on every rank)."""
    data_parallel = ps.get_data_parallel_world_size() > 1 and not partitions_parameters(config)
    tensor_parallel = ps.get_tensor_model_parallel_world_size() > 1
    return data_parallel or tensor_parallel or _ties_across_stages(config)


def _describe_holders(digests: torch.Tensor, ranks: list[int]) -> str:
    """'rank 0 holds 3f2a..., rank 1 holds 9b1c...': the ranks grouped by what they hold."""
    holders: dict[bytes, list[int]] = {}
    for rank, row in zip(ranks, digests, strict=True):
        holders.setdefault(row.cpu().numpy().tobytes(), []).append(rank)
    parts = []
    for key, members in holders.items():
        who = f"rank {members[0]}" if len(members) == 1 else f"ranks {members}"
        verb = "holds" if len(members) == 1 else "hold"
        parts.append(f"{who} {verb} sha256 {key.hex()[:12]}")
    return ", ".join(parts)


def _first_difference(comparison: _Comparison, step: int) -> str | None:
    """Collective over the comparison's group: the message for its first parameter whose
    copies differ, or None."""
    if not comparison.params:
        return None
    local = to_device(torch.stack([digest(held_tensor(p)) for p in comparison.params]))
    gathered = collectives.all_gather(local, comparison.group)  # [ranks, params, words]
    same = (gathered == gathered[:1]).all(dim=2).all(dim=0)
    if bool(same.all()):
        return None
    index = int((~same).nonzero()[0])
    ranks = dist.get_process_group_ranks(comparison.group)
    return (
        f"replica check at step {step}: {comparison.names[index]} is not the same on ranks "
        f"{ranks} ({comparison.what}): {_describe_holders(gathered[:, index], ranks)}"
    )


class ReplicaCheck:
    """``train.resilience.check_replicas_interval`` for one run: built once the engine holds the
    model (ZeRO-3 partitions parameters when it is built)."""

    def __init__(self, model: torch.nn.Module, config: RunConfig) -> None:
        self.model, self.config = model, config
        self.interval = config.train.resilience.check_replicas_interval
        self.last_checked: int | None = None
        if (
            self.interval
            and ps.get_data_parallel_world_size() > 1
            and partitions_parameters(config)
        ):
            if dist.get_rank() == 0:
                print(
                    "replica check: ZeRO-3 keeps one copy of each parameter, partitioned "
                    "across the data-parallel ranks; only tensor-parallel replicas and tied "
                    "embedding copies are compared",
                    file=sys.stderr,
                    flush=True,
                )

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def at_end(self, step: int) -> None:
        """The check once more after the last step, unless that step was just checked."""
        if self.interval > 0 and self.last_checked != step:
            self.run(step)

    def run(self, step: int) -> None:
        """Collective: raise ``ReplicaMismatch`` on every rank if any copy differs."""
        self.last_checked = step
        if not anything_to_compare(self.config):
            return
        findings = [_first_difference(c, step) for c in comparisons(self.model, self.config)]
        mine = next((f for f in findings if f is not None), None)
        # Every rank raises the same message, also those whose own groups agree.
        found = [f for f in collectives.gather_objects(mine) if f is not None]
        if found:
            raise ReplicaMismatch(
                f"{found[0]}. The run stops here: resume from a checkpoint saved before "
                "this step, and look for what updates that parameter on one rank only"
            )
