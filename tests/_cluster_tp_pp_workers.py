"""Ranks for tests/test_cluster_tp_pp.py: the real training loop, and each rank's
parameters as it started and as it ended (tests only).

``train_and_dump`` keeps a handle on the model that the loop builds (by wrapping the
loop's ``make_engine``), so that parameters which must stay identical across ranks
(sequence-parallel biases across TP ranks, a tied embedding's two copies across pipeline
stages) can be compared after the run: the run's checkpoint keeps one replica of each and
would hide a drift.
"""

from __future__ import annotations

from pathlib import Path

from _training import config_for, save_initial_weights, set_rank_env, synthetic_datasets


def dump_path(root: str | Path, name: str, rank: int) -> Path:
    return Path(root, f"{name}.params-rank{rank}.pt")


def _parameters(model) -> dict:
    import torch

    return {
        name: param.detach().to(device="cpu", dtype=torch.float32).clone()
        for name, param in model.named_parameters()
    }


def _sharded_names(model) -> list[str]:
    """Parameters Megatron splits across tensor-parallel ranks; the others are replicas."""
    return [
        name
        for name, param in model.named_parameters()
        if getattr(param, "tensor_model_parallel", False)
    ]


def train_and_dump(rank, world_size, port, root, inits, runs) -> None:
    """Save each ``(name, overrides)`` of ``inits`` as TP=1 initial weights (one rank), then
    train each ``(name, overrides)``; rank ``r`` writes the parameters it started and ended
    with to ``dump_path(root, name, r)``, rank 0 the exit code to ``root/name.exit``."""
    import torch

    import cqk_megatron.training.loop as loop

    if inits:
        save_initial_weights(rank, world_size, port, root, inits)
    set_rank_env(rank, world_size, port)
    built = {}
    make_engine = loop.make_engine

    def keep_model(model, config):
        built["model"], built["initial"] = model, _parameters(model)
        return make_engine(model, config)

    loop.make_engine = keep_model
    try:
        for name, overrides in runs:
            config = config_for(root, name, overrides)
            outcome = loop.train(config, datasets=synthetic_datasets(config))
            model = built.pop("model")
            dump = {
                "initial": built.pop("initial"),
                "final": _parameters(model),
                "sharded": _sharded_names(model),
            }
            torch.save(dump, dump_path(root, name, rank))
            if rank == 0:
                Path(root, f"{name}.exit").write_text(f"{outcome}\n")
    finally:
        loop.make_engine = make_engine


TP_GRADS = "cqk_megatron/model/attention/tp_grads.py"


def tp_sums_path(root: str | Path, name: str) -> Path:
    return Path(root, f"{name}.tp-sums.json")


def train_and_count_tp_sums(rank, world_size, port, root, runs) -> None:
    """Train each ``(name, overrides, per_parameter)``, counting the all-reduces that
    ``attention/tp_grads.py`` makes (``_collective_audit`` wraps ``torch.distributed``);
    ``per_parameter`` keeps DeepSpeed's engine on the per-micro-batch hooks where it would
    sum once per step (``engines.deepspeed.when_to_sum_tp_grads`` answers ``HOOKS``). Rank
    ``r`` writes its final parameters and, where the TP sum runs on its ZeRO partition, the
    slices it summed there to ``dump_path(root, name, r)``; rank 0 the exit code
    to ``root/name.exit`` and, to ``tp_sums_path``, the count and the number of parameters
    whose TP partial gradients the run summed."""
    import json
    from collections import Counter

    import _collective_audit
    import torch

    import cqk_megatron.training.engines.deepspeed as deepspeed_engine
    import cqk_megatron.training.loop as loop

    set_rank_env(rank, world_size, port)
    counts: Counter = Counter()
    _collective_audit.install(counts)

    def tp_all_reduces() -> int:
        return sum(
            n for (caller, fn, _), n in counts.items() if (caller, fn) == (TP_GRADS, "all_reduce")
        )

    built = {}
    make_engine, when = loop.make_engine, deepspeed_engine.when_to_sum_tp_grads
    hooks = deepspeed_engine.TpGradSum.HOOKS

    def keep_model(model, config):
        built["model"], built["engine"] = model, make_engine(model, config)
        return built["engine"]

    loop.make_engine = keep_model
    try:
        for name, overrides, per_parameter in runs:
            deepspeed_engine.when_to_sum_tp_grads = (
                (lambda config: hooks) if per_parameter else when
            )
            config = config_for(root, name, overrides)
            before = tp_all_reduces()
            outcome = loop.train(config, datasets=synthetic_datasets(config))
            model, engine = built.pop("model"), built.pop("engine")
            summed = [p for p in model.parameters() if getattr(p, "cqk_tp_partial_grad", False)]
            partition = engine.megatron_sums.partition_layout
            dump = {"final": _parameters(model), "partition": partition}
            torch.save(dump, dump_path(root, name, rank))
            if rank == 0:
                Path(root, f"{name}.exit").write_text(f"{outcome}\n")
                counted = {"all_reduces": tp_all_reduces() - before, "parameters": len(summed)}
                tp_sums_path(root, name).write_text(json.dumps(counted))
    finally:
        loop.make_engine = make_engine
        deepspeed_engine.when_to_sum_tp_grads = when
