"""Data-parallel engines (``train.engine``), registered by name like the launch backends
and the attention variants.

Each engine has two halves. The torch-free one, an ``EngineSpec`` (``spec.py``; the
shipped ones in ``deepspeed_spec.py`` and ``megatron_spec.py``), owns its settings, its
config rules, its optimizer shardings (``shardings.py``: the one list of their names),
and what the planner and the checks ask of it; ``config.validate`` runs it on login
nodes. The other, an ``Engine`` subclass (``protocol.py``: the protocol the training loop
calls; ``deepspeed.py``, ``megatron.py``), wraps the model and steps the optimizer.
``register_engine`` adds one; docs/engines.md, "Adding an engine".

This module imports only the torch-free half.
"""

from cqk_megatron.training.engines.registry import (
    SHIPPED_SHARDINGS,
    UnknownEngineError,
    engine_class,
    engine_names,
    engine_of,
    engine_spec,
    register_engine,
    sharding_name,
    sharding_settings,
)
from cqk_megatron.training.engines.shardings import (
    DDP,
    DISTOPT,
    SHARDINGS,
    ZERO1,
    ZERO2,
    ZERO3,
    Sharding,
    zero_aliases,
)
from cqk_megatron.training.engines.spec import EngineSpec

__all__ = [
    "SHIPPED_SHARDINGS",
    "DDP",
    "DISTOPT",
    "SHARDINGS",
    "ZERO1",
    "ZERO2",
    "ZERO3",
    "EngineSpec",
    "Sharding",
    "UnknownEngineError",
    "engine_class",
    "engine_names",
    "engine_of",
    "engine_spec",
    "register_engine",
    "sharding_name",
    "sharding_settings",
    "zero_aliases",
]
