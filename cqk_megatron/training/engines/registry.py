"""Engines by name: ``train.engine=NAME`` picks one.

    from cqk_megatron.training.engines import EngineSpec, register_engine
    register_engine("mine", MySpec())       # then: train.engine=mine

The two that ship are registered here by their specs, which are torch-free; each names
its engine class as ``"module:Class"``, imported on first use (``engine_class``). So
``config.validate`` reads the names and runs every engine's rules without torch. Nothing
outside ``training/engines/`` compares an engine's name (tests/test_layering.py).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from cqk_megatron.errors import Refusal
from cqk_megatron.training.engines.deepspeed_spec import DeepSpeedSpec
from cqk_megatron.training.engines.megatron_spec import MegatronSpec
from cqk_megatron.training.engines.shardings import SHARDINGS
from cqk_megatron.training.engines.spec import EngineSpec

_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")
_ENGINES: dict[str, EngineSpec] = {"deepspeed": DeepSpeedSpec(), "megatron": MegatronSpec()}
# the optimizer shardings that the shipped engines train with (the planner's candidates)
SHIPPED_SHARDINGS = tuple(name for spec in _ENGINES.values() for name in spec.shardings)


class UnknownEngineError(Refusal, ValueError):
    """A ``train.engine`` that nothing registered."""


def register_engine(name: str, spec: EngineSpec) -> None:
    """Make ``spec`` the engine called ``name`` (a new name, or the same spec again)."""
    if not _NAME.match(name):
        raise ValueError(f"engine name {name!r}: lower-case letters, digits, '-' and '_'")
    if not isinstance(spec, EngineSpec):
        raise TypeError(f"engine {name!r}: {spec!r} is not an engines.EngineSpec instance")
    known = _ENGINES.get(name)
    if known is not None and known is not spec:
        raise ValueError(f"engine {name!r} is already registered ({type(known).__qualname__})")
    for sharding in spec.shardings:
        if sharding not in SHARDINGS:
            raise ValueError(
                f"engine {name!r}: sharding {sharding!r} is unknown; choose from {list(SHARDINGS)}"
            )
        owner = next((n for n, s in _ENGINES.items() if sharding in s.shardings), name)
        if owner != name:
            raise ValueError(f"engine {name!r}: sharding {sharding!r} is {owner}'s")
    _ENGINES[name] = spec


def engine_names() -> list[str]:
    return list(_ENGINES)


def engine_spec(name: str) -> EngineSpec:
    """The spec of the engine called ``name``; ``UnknownEngineError`` listing the known
    names if there is none."""
    spec = _ENGINES.get(name)
    if spec is None:
        raise UnknownEngineError(
            f"train.engine={name!r} is unknown; choose one of {engine_names()} (a new one is "
            "registered with cqk_megatron.training.engines.register_engine)"
        )
    return spec


def engine_of(config: Any) -> EngineSpec:
    """The spec of ``config.train.engine`` (``config``: a ``RunConfig``)."""
    return engine_spec(config.train.engine)


def engine_class(name: str) -> type:
    """The ``engines.protocol.Engine`` subclass of the engine called ``name`` (imported here
    the first time: it needs torch)."""
    engine = engine_spec(name).engine
    if isinstance(engine, str):
        module, _, attribute = engine.partition(":")
        engine = getattr(importlib.import_module(module), attribute)
    if not isinstance(engine, type):
        raise TypeError(f"engine {name!r}: {engine!r} is not a class")
    return engine


# -- what layout.json records: an optimizer sharding as its engine and train.zero_stage --


def sharding_name(engine: str, zero_stage: int) -> str:
    """The optimizer sharding of ``train.engine`` and ``train.zero_stage``."""
    return engine_spec(engine).sharding_at(zero_stage)


def sharding_settings(sharding: str) -> dict[str, Any]:
    """``{"engine": ..., "zero_stage": ...}`` of the engine that trains with ``sharding``."""
    for name, spec in _ENGINES.items():
        if sharding in spec.shardings:
            return {"engine": name, "zero_stage": spec.shardings[sharding]}
    raise ValueError(f"no registered engine trains with the optimizer sharding {sharding!r}")
