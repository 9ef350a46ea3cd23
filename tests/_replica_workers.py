"""Ranks for tests/test_replicas.py: the real training loop, with one parameter pushed off
its replicas on one rank (the replica check's negative controls; tests only)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from _training import set_rank_env, train_attempts

OFFSET = 1e-3  # far above any rounding, far below anything that changes the loss's course


@dataclass(frozen=True)
class Perturbation:
    """After optimizer step ``step``, add ``OFFSET`` to the parameter whose full-model name
    ends with ``suffix``, on global rank ``rank`` only."""

    suffix: str
    rank: int
    step: int


@contextlib.contextmanager
def _perturbing(perturbation: Perturbation | None):
    """The loop's engines, with ``perturbation`` applied after the step it names."""
    import torch
    import torch.distributed as dist

    from cqk_megatron.training import loop, replicas

    original = loop.make_engine

    def make_engine(model, config):
        engine = original(model, config)
        train_step, done = engine.train_step, [0]

        def perturbed_step(micro_batches):
            result = train_step(micro_batches)
            done[0] += 1
            if done[0] == perturbation.step and dist.get_rank() == perturbation.rank:
                named = replicas.named_parameters(model)
                (param,) = [p for n, p in named if n.endswith(perturbation.suffix)]
                with torch.no_grad():  # what this rank holds: under ZeRO-3 its partition
                    replicas.held_tensor(param).add_(OFFSET)
            return result

        engine.train_step = perturbed_step
        return engine

    if perturbation is not None:
        loop.make_engine = make_engine
    try:
        yield
    finally:
        loop.make_engine = original


def perturbed_train_attempts(rank, world_size, port, root, runs) -> None:
    """``_training.train_attempts`` of each ``(name, overrides, perturbation)``: a
    ``Perturbation``, None, or a fault of ``_gpu_path_workers`` by name (``unsummed``: the
    sequence-parallel norms' gradients are not summed across TP ranks)."""
    from _gpu_path_workers import _fault

    set_rank_env(rank, world_size, port)
    for name, overrides, perturbation in runs:
        fault = perturbation if isinstance(perturbation, str) else "none"
        off = perturbation if isinstance(perturbation, Perturbation) else None
        with _perturbing(off), _fault(fault):
            train_attempts(rank, world_size, port, root, [(name, overrides)])
