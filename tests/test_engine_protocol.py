"""The engine protocol (``training/engines/protocol.py``): both engines implement every method of
``Engine`` with its signature, a class that misses one cannot be built, and the loop and
checkpointing call nothing on an engine that the protocol does not declare.

Static checks only (no model, no process group): the engines' behaviour is
``test_training.py``'s and ``test_megatron_engine.py``'s."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from cqk_megatron.training.engines.deepspeed import DeepSpeedEngine
from cqk_megatron.training.engines.megatron import MegatronEngine
from cqk_megatron.training.engines.protocol import Engine

TRAINING = Path(__file__).resolve().parents[1] / "cqk_megatron" / "training"
ENGINES = [DeepSpeedEngine, MegatronEngine]
# what the protocol declares: every abstract method (``__init__`` included), and every
# public method with a default that an engine may override (``whole_weights``, and the
# classmethod ``optimizer_restart_reason``)
DECLARED = sorted(
    {
        *Engine.__abstractmethods__,
        *(
            name
            for name, value in vars(Engine).items()
            if (callable(value) or isinstance(value, classmethod)) and name[0] != "_"
        ),
    }
)


def _shape(function) -> list[tuple[str, object]]:
    """Parameter names and kinds, in order: what a caller relies on."""
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


def protocol_problems(cls: type) -> list[str]:
    """Why ``cls`` does not implement ``Engine``; empty when it does."""
    if not issubclass(cls, Engine):
        return [f"{cls.__name__} does not derive from Engine"]
    problems = [f"{cls.__name__}.{name} is missing" for name in sorted(cls.__abstractmethods__)]
    for name in DECLARED:
        method = getattr(cls, name)
        if name in cls.__abstractmethods__:
            continue
        if _shape(method) != _shape(getattr(Engine, name)):
            problems.append(
                f"{cls.__name__}.{name}{inspect.signature(method)} differs from "
                f"Engine.{name}{inspect.signature(getattr(Engine, name))}"
            )
    return problems


def test_the_protocol_declares_what_an_engine_does():
    assert DECLARED == [
        "__init__",
        "eval_loss",
        "load_state",
        "optimizer_restart_reason",
        "save_state",
        "set_lr",
        "train_step",
        "whole_weights",
    ]


@pytest.mark.parametrize("engine", ENGINES, ids=lambda cls: cls.__name__)
def test_each_engine_implements_the_protocol(engine):
    assert protocol_problems(engine) == []
    assert not inspect.isabstract(engine)


def test_an_engine_that_misses_a_method_is_refused():
    class NoEval(Engine):
        def __init__(self, model, config) -> None:
            pass

        def set_lr(self, lr: float) -> None:
            pass

        def train_step(self, micro_batches):
            pass

        def save_state(self, folder) -> None:
            pass

        def load_state(self, folder) -> None:  # model_folder forgotten
            pass

    missing, differs = protocol_problems(NoEval)
    assert missing == "NoEval.eval_loss is missing"
    assert differs.startswith("NoEval.load_state(self, folder) ") and "model_folder" in differs
    with pytest.raises(TypeError, match="eval_loss"):
        NoEval(None, None)
    assert protocol_problems(type("Loose", (), {})) == ["Loose does not derive from Engine"]


def _engine_attributes(path: Path) -> dict[str, int]:
    """Each ``engine.<attribute>`` used in ``path``, with its first line."""
    used: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "engine"
        ):
            used.setdefault(node.attr, node.lineno)
    return used


@pytest.mark.parametrize("module", ["loop.py", "callbacks/validation.py", "checkpoint.py"])
def test_the_loop_and_checkpointing_use_only_the_protocol(module):
    used = _engine_attributes(TRAINING / module)
    assert used, f"{module} no longer calls an engine: update this test"
    undeclared = {name: line for name, line in used.items() if name not in DECLARED}
    assert undeclared == {}, f"{module} calls engine methods Engine does not declare"


def test_a_sharding_saved_by_another_engine_is_named_with_that_engine_s_format():
    """A resume under another engine restarts the optimizer; the reason says which engine
    wrote the saved state and what its folder holds (its spec's ``checkpoint_format``)."""
    from cqk_megatron.parallel.layout import Layout
    from cqk_megatron.training.engines import engine_spec
    from cqk_megatron.training.engines.protocol import sharding_change

    zero1, zero2 = Layout(1, 1, 2, "zero1"), Layout(1, 1, 2, "zero2")
    distopt = Layout(1, 1, 2, "distopt")
    assert sharding_change(zero1, zero1) is None
    same_engine = sharding_change(zero1, zero2)
    assert same_engine == "it was saved with another optimizer sharding (zero1; this run: zero2)"
    across = sharding_change(zero1, distopt)
    assert across is not None and across.startswith(same_engine.replace("zero2", "distopt"))
    assert "train.engine=deepspeed" in across and "train.engine=megatron" in across
    assert engine_spec("deepspeed").checkpoint_format in across
