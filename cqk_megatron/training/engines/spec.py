"""The torch-free half of an engine: what the rest of cqk-megatron asks about it without
building it.

An ``EngineSpec`` owns its engine's settings, its config rules (run by
``config.validate`` on login nodes, where importing torch can take 25 s), the optimizer
shardings it trains with (what ``layout.json`` records), whether it needs Megatron's
gloo groups, and the facts that the step-time model and the replica checks need. Its
engine class is named as ``"module:Class"`` and imported on first use (the class itself
also does). The config arrives duck-typed (``Any``): this module sits beside ``config/``
and imports nothing of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from cqk_megatron.training.engines.shardings import SHARDINGS, Sharding


class EngineSpec:
    """One engine, as the registry holds it. A subclass sets the class attributes and
    overrides the rules it has; the defaults fit an engine with one sharding and none."""

    # the ``engines.protocol.Engine`` subclass, or "module:Class" until it is first asked for
    engine: ClassVar[type | str]
    # each optimizer sharding it trains with -> the train.zero_stage that layout.json
    # records for it (an engine with one sharding takes any train.zero_stage)
    shardings: ClassVar[Mapping[str, int]]
    # the train.* fields it reads (documentation; its rules refuse the others' settings)
    settings: ClassVar[tuple[str, ...]] = ()
    # what its ``engine/`` checkpoint folder holds
    checkpoint_format: ClassVar[str] = ""
    # Megatron's gloo twins of its process groups (Megatron's distributed optimizer's
    # checkpoints use them; elsewhere they cost a rendezvous per group at start-up)
    gloo_groups: ClassVar[bool] = False

    def sharding_at(self, zero_stage: int) -> str:
        """The sharding that ``train.zero_stage`` selects (or a layout.json records)."""
        for name, stage in self.shardings.items():
            if stage == zero_stage or len(self.shardings) == 1:
                return name
        raise ValueError(
            f"train.zero_stage={zero_stage} selects none of this engine's shardings "
            f"{dict(self.shardings)}"
        )

    def sharding(self, config: Any) -> Sharding:
        """What ``config`` (a ``RunConfig``) splits over its data-parallel ranks."""
        return SHARDINGS[self.sharding_at(config.train.zero_stage)]

    def config_errors(self, config: Any) -> list[str]:
        """Why this engine cannot train ``config`` (a ``RunConfig`` whose fields are each
        valid), one message per reason naming the field and the fix; empty if it can."""
        return []

    def hardware_errors(self, config: Any, hardware: Any) -> list[str]:
        """Why it cannot train ``config`` on a machine with ``hardware``'s facts
        (``config.checks.Hardware``; read a fact only where a rule needs it)."""
        return []

    def offloads(self, config: Any) -> bool:
        """Whether its optimizer state lives in host memory (the step-time model does
        not price that)."""
        return False

    def shards_optimizer(self, config: Any) -> bool:
        return self.sharding(config).optimizer

    def shards_gradients(self, config: Any) -> bool:
        """Gradients reduce-scattered bucket by bucket inside every backward."""
        return self.sharding(config).gradients

    def partitions_parameters(self, config: Any) -> bool:
        """Each rank holds a partition of every parameter, gathered for each use: its
        replicas of a parameter are not whole, so the replica checks skip data parallel."""
        return self.sharding(config).parameters
