"""What the training loop asks of a data-parallel engine (``train.engine``).

Two engines implement it: ``deepspeed.DeepSpeedEngine`` (DeepSpeed ZeRO) and
``megatron.MegatronEngine`` (Megatron-Core's DDP and distributed optimizer). The loop
(``loop.py``) and checkpointing (``checkpoint.py``) call an engine only through this
class, found by name in the registry (``registry.engine_class``), so a third engine is
one subclass and one spec (``spec.EngineSpec``); ``abc`` refuses to build one that lacks a
method, and ``tests/test_engine_protocol.py`` checks both engines' signatures against it.

In the spirit of OLMo-core's ``TrainModule``: the engine owns the model's optimizer and
the forward/backward/step of one global batch; the loop owns the schedule (learning
rate, when to evaluate and save), the data order and the trainer state. Unlike
``TrainModule`` the engine returns the step's loss instead of recording metrics, and its
state goes to folders (each engine has its own sharded format) rather than a state dict.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from cqk_megatron.config import RunConfig
from cqk_megatron.parallel.layout import Layout
from cqk_megatron.training.engines.registry import engine_spec, sharding_settings

Batch = dict[str, torch.Tensor]  # one micro-batch from ``sampler.fetch``, on the device


@dataclass
class StepResult:
    loss: float  # mean over the global batch's tokens (every rank gets it)
    grad_norm: float
    skipped: bool  # the update was skipped (non-finite gradients)


class Engine(ABC):
    """One rank's share of a data-parallel engine around its Megatron model.

    Every method is collective: all ranks call it, in the same order, with their own
    micro-batches (this rank's data-parallel share of the global batch).
    """

    @abstractmethod
    def __init__(self, model: torch.nn.Module, config: RunConfig) -> None:
        """Wrap ``model`` (this rank's ``GPTModel`` or model chunks, with its weights
        already loaded when they come from a checkpoint) and build the optimizer."""

    @abstractmethod
    def set_lr(self, lr: float) -> None:
        """The learning rate for the next ``train_step`` (the loop owns the schedule)."""

    @abstractmethod
    def train_step(self, micro_batches: list[Batch]) -> StepResult:
        """Forward and backward over every micro-batch of the global batch, then one
        optimizer step (skipped, and said so, when a gradient is not finite)."""

    @abstractmethod
    def eval_loss(self, micro_batches: list[Batch]) -> float:
        """The mean loss over the global batch, without gradients or an update."""

    def whole_weights(self) -> AbstractContextManager:
        """A context in which every parameter of the model holds its whole value, to be
        read (a save of the weights). An engine that partitions the parameters themselves
        (DeepSpeed ZeRO-3) gathers them here; for the others there is nothing to do."""
        return nullcontext()

    @abstractmethod
    def save_state(self, folder: Path) -> None:
        """The engine's state for an exact resume under this layout (optimizer, and the
        weights where the engine keeps its own copy) in ``folder``."""

    @abstractmethod
    def load_state(self, folder: Path, model_folder: Path) -> None:
        """What ``save_state`` wrote to ``folder``; ``model_folder`` holds the checkpoint's
        layout-free weights, for an engine whose own state does not."""

    @classmethod
    def optimizer_restart_reason(cls, saved: Layout, current: Layout, folder: Path) -> str | None:
        """Why the state that ``save_state`` wrote to ``folder`` under layout ``saved``
        cannot be loaded under ``current`` (another layout), or None when it can. Asked on
        one rank before any engine is built. By default it loads under its own layout
        only; an engine whose format reshards says where."""
        return sharding_change(saved, current) or (
            f"this engine reshards its optimizer state under no other layout ({cls.__name__})"
        )


def sharding_change(saved: Layout, current: Layout) -> str | None:
    """Why no engine loads optimizer state saved under another optimizer sharding; when
    another engine saved it, what its ``engine/`` folder holds, which this one cannot read."""
    if saved.optimizer_sharding == current.optimizer_sharding:
        return None
    reason = (
        f"it was saved with another optimizer sharding ({saved.optimizer_sharding}; this "
        f"run: {current.optimizer_sharding})"
    )
    saved_engine = sharding_settings(saved.optimizer_sharding)["engine"]
    current_engine = sharding_settings(current.optimizer_sharding)["engine"]
    if saved_engine == current_engine:
        return reason
    return (
        f"{reason} by train.engine={saved_engine}, whose state is "
        f"{engine_spec(saved_engine).checkpoint_format}; train.engine={current_engine} "
        "reads only its own"
    )
