"""What differs between two run configs, and which differences matter for a checkpoint.

A checkpoint records the config it was saved with (``iter_*/config.yaml``), and a run
folder the config of its last attempt that trained a step (``config.yaml``, with every
attempt in ``history.jsonl``). Resuming, ``train.init_from``, ``cqk convert export`` and
the launcher's pre-flight compare them with the config in hand:

- a change of a *shape* key makes the weights of one unloadable into the other;
- a change of a *model* key (``MODEL_KEYS``: the shape keys and every other key that
  changes what the model computes, such as the coupling's steps) makes a resumed run
  another model than the one its earlier steps trained, so a resume refuses it: the
  change is a new run (``train.init_from`` starts one from these weights);
- a change of a *schedule* key changes the learning rate from the resume step on;
- every other change (layout, engine, ZeRO stage, batch split, the learning-rate tail)
  keeps the model's function: a resume takes it and the run's history records it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cqk_megatron.config import RunConfig, to_dict
from cqk_megatron.config.schema import flatten

# Keys that decide the shapes of the model's parameters (the parallel layout does not:
# checkpoints are resharded on load).
SHAPE_KEYS = (
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.num_query_groups",
    "model.ffn_hidden_size",
    "model.vocab_size",
    "model.make_vocab_size_divisible_by",
    "model.normalization",
    "model.swiglu",
    "model.tie_embeddings",
    "attention.coupling",
    "attention.scoring",
    "attention.coupling_hidden",
    "attention.invertible_layers",
)
# Keys that change what the model computes with the same parameters: with the shape keys,
# the keys whose change makes a resumed run another model than its earlier steps trained
# (a model family is its fields: normalization, swiglu, position embedding, biases).
FUNCTION_KEYS = (
    "model.seq_length",
    "model.rotary_base",
    "model.layernorm_epsilon",
    "model.position_embedding_type",
    "model.add_bias_linear",
    "attention.steps",
    "attention.position",
    "attention.invertible_scale_bound",
    # lambda's constant term and the (1 - lambda_init) factor; the norm after out1 - lambda
    # out2 ("none" has no norm weight at all)
    "attention.differential_lambda_init",
    "attention.differential_norm",
)
MODEL_KEYS = SHAPE_KEYS + FUNCTION_KEYS
# Keys of ``cqk_megatron.training.lr_schedule.learning_rate``.
SCHEDULE_KEYS = (
    "train.train_steps",
    "train.optimizer.lr",
    "train.schedule.min_lr",
    "train.schedule.decay",
    "train.schedule.warmup_steps",
    "train.schedule.wsd_decay_fraction",
)
# Where a run folder is, not what it trains.
LOCATION_KEYS = ("name", "log.root")


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {self.old!r} -> {self.new!r}"


def changes(old: RunConfig, new: RunConfig, keys: tuple[str, ...] | None = None) -> list[Change]:
    """Every key whose value differs (only ``keys`` if given), in a stable order."""
    a, b = flatten(to_dict(old)), flatten(to_dict(new))
    names = keys if keys is not None else tuple(sorted(set(a) | set(b)))
    return [Change(k, a.get(k), b.get(k)) for k in names if a.get(k) != b.get(k)]


def shape_changes(old: RunConfig, new: RunConfig) -> list[Change]:
    return changes(old, new, SHAPE_KEYS)


def model_changes(old: RunConfig, new: RunConfig) -> list[Change]:
    """The changes that make ``new`` another model than ``old`` (``MODEL_KEYS``)."""
    return changes(old, new, MODEL_KEYS)


def kept_function_changes(old: RunConfig, new: RunConfig) -> list[Change]:
    """The changes a resume takes: every one but the model's and the folder's location."""
    skip = set(MODEL_KEYS) | set(LOCATION_KEYS)
    return [c for c in changes(old, new) if c.key not in skip]


def schedule_changes(old: RunConfig, new: RunConfig) -> list[Change]:
    return changes(old, new, SCHEDULE_KEYS)


def listed(found: list[Change], limit: int = 8) -> str:
    text = ", ".join(str(c) for c in found[:limit])
    return text + (f" and {len(found) - limit} more" if len(found) > limit else "")


def new_run_fix(run: str, checkpoint: str = "CHECKPOINT") -> str:
    """How to train a change of the model's function: never as a resume of ``run``."""
    return (
        f"set them back to resume run '{run}', or train the change as a new run (another "
        f"name=..., from these weights with train.init_from={checkpoint} or --resume "
        f"weights:{checkpoint}), or start '{run}' over with --resume none"
    )


def model_change_message(where: str, found: list[Change], fix: str) -> str:
    """One line: ``where`` holds another model (``found``: its ``MODEL_KEYS`` changes)."""
    kind = "shape" if any(c.key in SHAPE_KEYS for c in found) else "model"
    fields = ", ".join(f"{c.key}={c.old!r} (this config: {c.new!r})" for c in found)
    return f"{where} holds a run of another {kind}: {fields}; {fix}"


def shape_mismatch_message(saved: str, found: list[Change], fix: str) -> str:
    """One line: the model of ``saved`` differs in ``found``, and what to do."""
    fields = ", ".join(f"{c.key}={c.old!r} (this config: {c.new!r})" for c in found)
    return f"{saved} holds a model of another shape: {fields}; {fix}"
