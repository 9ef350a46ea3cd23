"""Ranks for tests/test_comm_audit.py: the real training loop with every collective
recorded, step by step (tests only)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from _collective_audit import TrafficRecorder
from _training import config_for, set_rank_env, synthetic_datasets


def _mark_steps(recorder: TrafficRecorder, dp_group: list) -> None:
    """Label each call with the training step it belongs to (the engines' ``train_step``)
    and note the data-parallel group's ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from cqk_megatron.training.engines.deepspeed import DeepSpeedEngine
    from cqk_megatron.training.engines.megatron import MegatronEngine

    for engine in (DeepSpeedEngine, MegatronEngine):
        original = getattr(engine.train_step, "_original", engine.train_step)

        @functools.wraps(original)
        def marked(self, micro_batches, _original=original):
            dp_group[:] = dist.get_process_group_ranks(ps.get_data_parallel_group())
            params = list(self.model.parameters())
            recorder.count_gradients(params)
            recorder.parameters = (sum(p.numel() for p in params), len(params))
            recorder.step = recorder.steps
            try:
                return _original(self, micro_batches)
            finally:
                recorder.steps += 1
                recorder.step = None

        marked._original = original
        engine.train_step = marked


def recorded_train_runs(rank, world_size, port, root, runs) -> None:
    """Train each ``(name, overrides, buckets)``, the engines' gradient buckets made
    ``1 / buckets`` of this rank's parameters (``traffic.BUCKETS_PER_BACKWARD``); rank
    ``r`` writes every collective it issued, the data-parallel group's ranks and its
    parameters (elements, tensors) to ``root/name-rank<r>.json``."""
    set_rank_env(rank, world_size, port)
    from cqk_megatron.perf import traffic
    from cqk_megatron.training.loop import train

    recorder = TrafficRecorder()
    recorder.install()
    dp_group: list = []
    _mark_steps(recorder, dp_group)
    for name, overrides, buckets in runs:
        traffic.BUCKETS_PER_BACKWARD = buckets
        recorder.clear()
        recorder.steps = 0
        config = config_for(root, name, overrides)
        train(config, resume="none", datasets=synthetic_datasets(config))
        out = {
            "dp_group": dp_group,
            "steps": recorder.steps,
            "parameters": recorder.parameters,
            "calls": recorder.finished(),
        }
        Path(root, f"{name}-rank{rank}.json").write_text(json.dumps(out))
