"""Ranks for tests/test_gpu_path.py: the real training loop with every collective of this
package audited, and two deliberate faults in the sequence-parallel norms (tests only)."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path

import _collective_audit
from _training import config_for, set_rank_env, synthetic_datasets


@contextlib.contextmanager
def _fault(name: str):
    """``unsummed``: the norms' partial gradients are not summed across TP ranks (the bug
    the hook fixes). ``marked``: the norms' parameters are also marked ``sequence_parallel``,
    as Megatron's own norms are, so that ``finalize_model_grads`` adds the sums again."""
    import cqk_megatron.model.norm as norm

    original = norm.sum_partial_grads_across_tp

    def marked(module, group):
        original(module, group)
        for parameter in module.parameters():
            parameter.sequence_parallel = True

    replacement = {"none": original, "unsummed": lambda module, group: None, "marked": marked}
    norm.sum_partial_grads_across_tp = replacement[name]
    try:
        yield
    finally:
        norm.sum_partial_grads_across_tp = original


def audited_train_runs(rank, world_size, port, root, inits, runs) -> None:
    """Save each ``(name, overrides)`` of ``inits`` as initial weights, then train each
    ``(name, overrides, fault[, resume])``; rank ``r`` writes the collectives it saw to
    ``root/audit-<world>-rank<r>.json`` and the exit codes to ``root/name.exit``."""
    set_rank_env(rank, world_size, port)
    from cqk_megatron.parallel.device import device
    from cqk_megatron.training.loop import train

    counts: Counter = Counter()
    _collective_audit.install(counts)
    for name, overrides in inits:
        _save_initial_weights(root, name, overrides)
    for name, overrides, fault, *resume in runs:
        config = config_for(root, name, overrides)
        with _fault(fault):
            outcome = train(
                config, resume=resume[0] if resume else "auto", datasets=synthetic_datasets(config)
            )
        if rank == 0:
            with Path(root, f"{name}.exit").open("a") as handle:
                handle.write(f"{outcome}\n")
    records = [
        {"caller": caller, "function": function, "devices": devices, "calls": n}
        for (caller, function, devices), n in sorted(counts.items())
    ]
    path = Path(root, f"audit-{world_size}-rank{rank}.json")
    path.write_text(json.dumps({"device": str(device()), "records": records}, indent=1))


def _save_initial_weights(root, name, overrides) -> None:
    """The TP=1 model from the seed as a weights-only checkpoint (every layout's start)."""
    import torch

    from cqk_megatron.model.gpt import build_model
    from cqk_megatron.parallel.process_groups import init_model_parallel, init_process_group
    from cqk_megatron.training import checkpoint

    init_process_group()
    config = config_for(root, name, overrides)
    init_model_parallel(config)
    torch.manual_seed(config.seed)
    checkpoint.save_weights(Path(root, name), build_model(config), config)
