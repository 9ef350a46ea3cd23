"""A run's parallel layout, torch-free: how its ranks split the model and who shards the
optimizer. The planner (``perf/fit.py``) proposes layouts; a checkpoint records the one
it was saved under (``layout.json``), so that a resume in the same layout loads it exactly,
and one in another layout knows what it resharded from (``training/checkpoint.resume_mode``).

``optimizer_sharding`` says who shards the optimizer state over data parallel, and how:
one of the names in ``training/engines/shardings.py`` (``zero1``-``zero3``: DeepSpeed ZeRO,
``distopt``: Megatron's distributed optimizer, ``ddp``: plain data parallel), each trained
by the engine whose spec lists it. "Engine" means ``train.engine`` alone, in
``layout.json`` too.
"""

from __future__ import annotations

from dataclasses import dataclass

from cqk_megatron.training.engines import DISTOPT, sharding_name, sharding_settings


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    optimizer_sharding: str = DISTOPT
    recompute: str = "none"
    vp: int | None = None
    sequence_parallel: bool = False
    recompute_method: str = "uniform"  # train.recompute_method (full only)
    recompute_num_layers: int | None = None  # train.recompute_num_layers (full only)

    def describe(self) -> str:
        vp = f" VP={self.vp}" if self.vp else ""
        sp = " SP" if self.sequence_parallel else ""
        return (
            f"TP={self.tp} PP={self.pp}{vp} DP={self.dp}{sp} {self.optimizer_sharding} "
            f"recompute={self.recompute_label()}"
        )

    def describe_sizes(self) -> str:
        """The parallel sizes alone, as a resume that changes them reports them."""
        return f"TP={self.tp} PP={self.pp} DP={self.dp}"

    def recompute_label(self) -> str:
        if self.recompute != "full":
            return self.recompute
        unit = self.recompute_num_layers
        return f"full/{self.recompute_method}" + (f"/{unit}" if unit else "")

    # -- what a checkpoint records -------------------------------------------------------
    # The sizes and the optimizer sharding decide how the optimizer state is split, so
    # whether a checkpoint loads exactly; the rest of the layout (recompute, VP, SP) does
    # not. The keys are those of every layout.json written so far: the sharding as the
    # training engine and its ZeRO stage ("engine": deepspeed | megatron, "zero_stage").

    def sharding(self) -> Layout:
        """This layout as a checkpoint records it: sizes and optimizer sharding only."""
        return Layout(self.tp, self.pp, self.dp, self.optimizer_sharding)

    def checkpoint_record(self) -> dict:
        """The ``layout.json`` of a checkpoint saved under this layout."""
        settings = sharding_settings(self.optimizer_sharding)
        return {
            "tensor_parallel": self.tp,
            "pipeline_parallel": self.pp,
            "data_parallel": self.dp,
            "engine": settings["engine"],
            "zero_stage": settings["zero_stage"],
        }

    @classmethod
    def from_checkpoint_record(cls, record: dict) -> Layout:
        """The layout a ``layout.json`` names (``sharding()`` of the one it was saved in)."""
        return cls(
            record["tensor_parallel"],
            record["pipeline_parallel"],
            record["data_parallel"],
            sharding_name(record["engine"], record["zero_stage"]),
        )
