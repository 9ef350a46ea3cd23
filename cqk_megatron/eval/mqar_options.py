"""The options of one MQAR run (``TrainOptions``), torch-free: ``cqk mqar --help`` builds
one flag per field, with the field's help, without loading torch (``mqar_train`` runs
them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cqk_megatron.eval.mqar_data import MQARSetting

# settings as SEQ_LENxNUM_KV_PAIRS (``mqar_data.MQARSetting.parse``)
DEFAULT_SETTINGS = ("64x4", "128x8", "256x16")
# Beyond the three above, the Zoology paper's harder points (longer sequences, more pairs).
HARDER_SETTINGS = ("256x32", "512x64")
POSITIONS = ("pre_rope", "post_rope")  # where the coupling sits relative to RoPE
MODELS = ("megatron", "plain")
SCHEDULES = ("wsd", "onecycle", "constant")
SOLVED = 0.99  # held-out accuracy that counts as solving a setting
# PyTorch's defaults, per kind of weight: Linear weight and bias U(+-1/sqrt(fan_in))
# (kaiming_uniform_ with a=sqrt(5)), Embedding N(0, 1). What plain_model's init="torch" draws.
REINIT_PARTS = ("torch", "torch_embeddings", "torch_linears")


def option(default, help: str, **kwargs):
    """A field with its command-line help (``metadata["help"]``)."""
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass
class TrainOptions:
    """A small model and a short AdamW run (the defaults are the project's MQAR setup)."""

    # the model
    model: str = option("megatron", "megatron: the project's GPTModel; plain: PlainLM")
    family: str = option("llama", "megatron: a model family of config.MODEL_FAMILIES")
    position: str = option(
        "pre_rope", "megatron, coupled variants with RoPE: pre_rope or post_rope"
    )
    megatron: list[str] = field(
        default_factory=list, metadata={"help": "extra RunConfig overrides (k=v)"}
    )
    # The project's 0.02 is GPT-2's choice for width 768; at width 64 it makes q.k 13x
    # smaller than PyTorch's default and slowed recall for every variant (mqar_gap.py)
    init_std: float | None = option(
        None, "megatron: model.init_method_std (default: 1/sqrt(3 x hidden_size))"
    )
    reinit: str | None = option(
        None,
        "megatron: redraw these weights from PyTorch's module defaults after Megatron's "
        "N(0, init_method_std) (default: keep Megatron's)",
    )
    plain: dict = field(
        default_factory=dict, metadata={"help": "PlainConfig fields for model=plain"}
    )
    vocab_size: int = option(256, "vocabulary size (keys and values are drawn from it)")
    hidden_size: int = option(64, "model width")
    num_layers: int = option(2, "transformer layers")
    num_heads: int = option(4, "attention heads (even, so differential scoring can pair them)")
    # the data
    train_examples: int | None = option(
        None, "a fixed training set of this many examples (default: a fresh batch each step)"
    )
    batch_size: int = option(64, "sequences per step (for sequence length 64, see --scale-batch)")
    # Keep tokens per step constant across settings: each example of a longer setting
    # also carries proportionally more queries.
    scale_batch: bool = option(
        False, "shrink the batch as sequences grow, keeping tokens per step constant"
    )
    power_a: float = option(0.01, "power-law parameter of the query-key gaps (Zoology's)")
    # the optimiser
    steps: int = option(300, "training steps (the schedule spans them)")
    # 3e-3, or weight decay 0.1, stalled 64x4 at ~25% in 500 steps
    lr: float = option(1e-3, "peak learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay")
    decay_dt: bool = option(True, "whether weight decay touches the coupling's dt parameter")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.98, "AdamW beta2")
    schedule: str = option(
        "wsd",
        "wsd (warmup-stable-decay), onecycle (torch's OneCycleLR with its defaults: 30 percent "
        "warmup, cosine annealing, beta1 cycled between 0.85 and 0.95) or constant",
    )
    warmup_fraction: float = option(0.1, "share of the steps spent warming up (wsd)")
    clip_grad: float = option(1.0, "gradient norm clipping (0: none)")
    # held-out evaluation
    eval_examples: int = option(512, "held-out sequences per evaluation")
    eval_every: int = option(0, "steps between evaluations (0: at the end only)")
    stop_at: float | None = option(None, "stop once held-out accuracy reaches this")
    stop_after: int | None = option(
        None, "stop after this many steps; the schedule still spans --steps"
    )
    seed: int = option(0, "seed of the model and the data")

    def batch_for(self, setting: MQARSetting) -> int:
        if not self.scale_batch:
            return self.batch_size
        return max(4, self.batch_size * 64 // setting.seq_len)

    def check(self) -> None:
        for name, value, allowed in (
            ("model", self.model, MODELS),
            ("schedule", self.schedule, SCHEDULES),
        ):
            if value not in allowed:
                raise ValueError(f"MQAR option {name}={value!r}; choose one of {list(allowed)}")
        if self.init_std is not None and not self.init_std > 0:
            raise ValueError(f"MQAR option init_std={self.init_std}; must be positive (or None)")
        if self.reinit is not None and self.reinit not in REINIT_PARTS:
            raise ValueError(
                f"MQAR option reinit={self.reinit!r}; choose one of {list(REINIT_PARTS)} or None"
            )
        if self.train_examples is not None and self.train_examples < 1:
            raise ValueError("MQAR option train_examples must be positive (or None: fresh)")
