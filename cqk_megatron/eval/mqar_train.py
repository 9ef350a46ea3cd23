"""Training one small model on MQAR and recording its held-out accuracy curve.

``train_run(variant, setting, options)`` builds the model (the project's Megatron
``GPTModel`` of either family, or the independent ``PlainLM``), trains it with AdamW on
fresh batches or on a fixed training set, evaluates held-out accuracy every
``eval_every`` steps, and returns the curve: ``(step, training examples seen, accuracy)``
triples. ``examples_to_reach`` reads the learning speed off a curve.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.nn.functional as F

from cqk_megatron.config import VARIANTS, RunConfig, load_config, validate
from cqk_megatron.eval.mqar_data import IGNORE_INDEX, MQARSetting, generate
from cqk_megatron.eval.mqar_models import (
    build_megatron,
    dt_parameters,
    query_logits,
    reinit_like_torch,
)
from cqk_megatron.eval.mqar_options import (  # noqa: F401  (their old home)
    MODELS,
    REINIT_PARTS,
    SCHEDULES,
    SOLVED,
    TrainOptions,
)
from cqk_megatron.eval.plain_model import SCORINGS as PLAIN_SCORINGS
from cqk_megatron.eval.plain_model import PlainConfig, PlainLM
from cqk_megatron.parallel.device import device, to_device


def width_init_std(hidden_size: int) -> float:
    """``1 / sqrt(3 * hidden_size)``: PyTorch's ``nn.Linear`` default (U(+-1/sqrt(fan_in)))
    as a normal std. 0.072 at width 64; 0.0208 at width 768, GPT-2's 0.02 there."""
    return 1 / math.sqrt(3 * hidden_size)


def model_config(variant: str, setting: MQARSetting, options: TrainOptions) -> RunConfig:
    """The RunConfig of the small MQAR Megatron model for ``variant`` (validated)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant '{variant}'; choose from {list(VARIANTS)}")
    coupling, scoring = VARIANTS[variant]
    config = load_config(
        None,
        [
            f"name=mqar-{variant}-{setting.label}",
            f"seed={options.seed}",
            f"model.family={options.family}",
            f"attention.coupling={coupling}",
            f"attention.scoring={scoring}",
            f"attention.position={options.position}",
            f"model.num_layers={options.num_layers}",
            f"model.hidden_size={options.hidden_size}",
            f"model.num_attention_heads={options.num_heads}",
            f"model.seq_length={setting.seq_len}",
            f"model.vocab_size={options.vocab_size}",
            "model.make_vocab_size_divisible_by=8",
            f"train.micro_batch_size={options.batch_size}",
            f"train.global_batch_size={options.batch_size}",
            f"model.init_method_std={options.init_std or width_init_std(options.hidden_size)}",
            *options.megatron,
        ],
    )
    return validate(config)


def plain_config(variant: str, setting: MQARSetting, options: TrainOptions) -> PlainConfig:
    """The ``PlainLM`` of ``variant`` (its coupling and scoring); ``options.plain`` sets
    any other ``PlainConfig`` field (``differential_norm``, ...)."""
    coupling, scoring = VARIANTS[variant]
    if scoring not in PLAIN_SCORINGS:
        raise ValueError(
            f"model=plain writes out scorings {list(PLAIN_SCORINGS)}, not {variant!r}'s {scoring!r}"
        )
    return PlainConfig(
        **{
            "vocab_size": options.vocab_size,
            "hidden": options.hidden_size,
            "layers": options.num_layers,
            "heads": options.num_heads,
            "seq_len": setting.seq_len,
            "coupling": coupling,
            "scoring": scoring,
            **options.plain,
        }
    )


def build(variant: str, setting: MQARSetting, options: TrainOptions) -> torch.nn.Module:
    """The seeded model of ``variant`` for ``setting``."""
    torch.manual_seed(options.seed)
    if options.model == "plain":
        with torch.device(device()):  # parameters made where the batches go
            return PlainLM(plain_config(variant, setting, options))
    model = build_megatron(model_config(variant, setting, options))
    if options.reinit is not None:
        reinit_like_torch(model, options.reinit)
    return model


def lr_factor(step: int, total: int, warmup_fraction: float) -> float:
    """WSD: warmup, constant, then a linear decay to 10% over the last 20%.

    Recall is learned in a sudden transition (induction heads forming); a cosine schedule
    lowers the rate before it and delayed it past 300 steps in our runs.
    """
    warmup = max(1, int(warmup_fraction * total))
    decay_start = int(0.8 * total)
    if step < warmup:
        return (step + 1) / warmup
    if step < decay_start:
        return 1.0
    return 1.0 - 0.9 * (step - decay_start) / max(1, total - decay_start)


def _optimizer(model: torch.nn.Module, options: TrainOptions):
    dts = {id(p) for p in dt_parameters(model)}
    decayed = [p for p in model.parameters() if options.decay_dt or id(p) not in dts]
    groups = [{"params": decayed, "weight_decay": options.weight_decay}]
    if not options.decay_dt and dts:
        groups.append(
            {"params": [p for p in model.parameters() if id(p) in dts], "weight_decay": 0.0}
        )
    optimizer = torch.optim.AdamW(
        groups, lr=options.lr, betas=(options.adam_beta1, options.adam_beta2)
    )
    if options.schedule == "onecycle":
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=options.lr, total_steps=options.steps
        )
    elif options.schedule == "wsd":
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, options.steps, options.warmup_fraction)
        )
    else:
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return optimizer, schedule


class Batches:
    """Fresh batches from one generator stream, or epochs over a fixed training set."""

    def __init__(self, setting: MQARSetting, options: TrainOptions, batch_size: int) -> None:
        self.setting, self.options, self.batch_size = setting, options, batch_size
        self.rng = np.random.default_rng(options.seed)
        self.fixed = None
        if options.train_examples is not None:
            self.fixed = generate(
                options.train_examples, setting, options.vocab_size, self.rng, options.power_a
            )
            self.order, self.cursor = self.rng.permutation(options.train_examples), 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fixed is None:
            o = self.options
            return generate(self.batch_size, self.setting, o.vocab_size, self.rng, o.power_a)
        picked = []
        while len(picked) < self.batch_size:  # an epoch ends: reshuffle, carry on
            if self.cursor == len(self.order):
                self.order, self.cursor = self.rng.permutation(len(self.order)), 0
            take = self.order[self.cursor : self.cursor + self.batch_size - len(picked)]
            picked.extend(take.tolist())
            self.cursor += len(take)
        index = torch.tensor(picked, device="cpu")  # indexes the host-side set
        return self.fixed[0][index], self.fixed[1][index]


@torch.no_grad()
def accuracy(
    model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, batch_size: int = 128
) -> float:
    """Fraction of labelled positions whose argmax prediction is the value."""
    was_training = model.training
    model.eval()
    correct = total = 0
    for start in range(0, inputs.shape[0], batch_size):
        tokens, target = to_device(
            (inputs[start : start + batch_size], labels[start : start + batch_size])
        )
        mask = target != IGNORE_INDEX
        predicted = query_logits(model, tokens, mask).argmax(dim=-1)
        correct += int((predicted == target[mask]).sum())
        total += int(mask.sum())
    model.train(was_training)
    return correct / max(total, 1)


def examples_to_reach(curve: list[dict], threshold: float) -> int | None:
    """Training examples seen at the first evaluation with accuracy >= ``threshold``
    (None if the curve never gets there)."""
    for point in curve:
        if point["accuracy"] >= threshold:
            return point["examples"]
    return None


def train_run(variant: str, setting: MQARSetting, options: TrainOptions, log=None) -> dict:
    """Train one seeded model on ``setting``; its held-out curve and final accuracy."""
    options.check()
    setting.check(options.vocab_size)
    model = build(variant, setting, options)
    optimizer, schedule = _optimizer(model, options)
    batch_size = options.batch_for(setting)
    batches = Batches(setting, options, batch_size)
    # The held-out set comes from another seed stream, as Zoology's test split does.
    test_inputs, test_labels = generate(
        options.eval_examples, setting, options.vocab_size, 10_000 + options.seed, options.power_a
    )
    curve: list[dict] = []

    def evaluate(step: int) -> float:
        value = accuracy(model, test_inputs, test_labels)
        curve.append({"step": step, "examples": step * batch_size, "accuracy": value})
        if log is not None:
            log(f"  step {step:>6}  examples {step * batch_size:>9,}  accuracy {value:.3f}")
        return value

    started = time.process_time()
    loss, step = float("nan"), 0
    if options.eval_every:
        evaluate(0)
    last = min(options.steps, options.stop_after or options.steps)
    while step < last:
        inputs, labels = batches.next()
        inputs, labels = to_device((inputs, labels))
        mask = labels != IGNORE_INDEX
        step_loss = F.cross_entropy(query_logits(model, inputs, mask).float(), labels[mask])
        optimizer.zero_grad(set_to_none=True)
        step_loss.backward()
        if options.clip_grad:
            torch.nn.utils.clip_grad_norm_(model.parameters(), options.clip_grad)
        optimizer.step()
        schedule.step()
        loss, step = step_loss.item(), step + 1
        if not math.isfinite(loss):
            break  # a diverged run: its last evaluation stands
        if options.eval_every and step % options.eval_every == 0 and step < last:
            if evaluate(step) >= (options.stop_at if options.stop_at is not None else math.inf):
                break
    if not curve or curve[-1]["step"] != step:
        evaluate(step)
    final = curve[-1]["accuracy"]
    return {
        "variant": variant,
        "setting": setting.label,
        "seq_len": setting.seq_len,
        "num_kv_pairs": setting.num_kv_pairs,
        "model": options.model,
        "family": options.family if options.model == "megatron" else "plain",
        "position": options.position,
        "seed": options.seed,
        "accuracy": final,
        "curve": curve,
        "examples_to_0.5": examples_to_reach(curve, 0.5),
        "examples_to_0.9": examples_to_reach(curve, 0.9),
        "solved": final >= SOLVED or examples_to_reach(curve, SOLVED) is not None,
        "chance": 1 / (options.vocab_size - options.vocab_size // 2),
        "final_train_loss": loss,
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch_size": batch_size,
        "steps": step,
        "train_cpu_seconds": time.process_time() - started,
        "options": asdict(options),
    }


def with_options(options: TrainOptions, **changes) -> TrainOptions:
    return dataclasses.replace(options, **changes)
