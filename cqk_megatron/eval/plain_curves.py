"""The Megatron model against the plain model on the demo's data: validation curves.

``cqk demo plain-curves --variants standard,coupled,differential`` (``cli/plain_curves.py``)
builds one run of ``configs/sweeps/demo_seeds.yaml`` (the demo's ``w128`` model) per variant,
copies its initial Megatron weights into ``eval/plain_model.py``'s independent model, and
trains the two side by side on the same batches (the run's dataset, sampler order,
learning-rate schedule, AdamW settings and gradient clipping), then prints the validation
loss of each at every ``train.eval_interval``. Both are trained by the same short loop
here, so a gap between the curves is a difference between the two models, nothing else.

``--steps N`` shortens every run (the schedule's warmup and evaluations scaled with it);
``--data`` is the folder ``cqk demo-corpus`` (or the demo's first stage) wrote.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from cqk_megatron.config import RunConfig, load_config, validate
from cqk_megatron.eval.mqar_models import plain_copy_of
from cqk_megatron.eval.plain_model import PlainLM
from cqk_megatron.training.lr_schedule import learning_rate
from cqk_megatron.training.sampler import collate, micro_batch_indices

REPO = Path(__file__).resolve().parents[2]
SEEDS_SWEEP = REPO / "configs" / "sweeps" / "demo_seeds.yaml"
Batch = dict[str, torch.Tensor]
LossFn = Callable[[torch.nn.Module, Batch], torch.Tensor]


def demo_run_config(variant: str, seed: int, data: Path, extra: list[str]) -> RunConfig:
    """The ``demo_seeds.yaml`` run of ``variant`` and ``seed``, reading ``data``."""
    from cqk_megatron.planner.sweep import expand_sweep

    runs = {run["name"]: run for run in expand_sweep(SEEDS_SWEEP)}
    run = runs[f"seeds-w128-{variant}-s{seed}"]
    overrides = [
        *run["overrides"],
        f"data.prefixes=[{data / 'demo_text_document'}]",
        f"data.tokenizer={data / 'tokenizer.model'}",
        *extra,
    ]
    return validate(load_config(run["config"], overrides))


def shortened(steps: int) -> list[str]:
    """``--steps``: the demo_seeds schedule's shape (7.5% warmup, ten evaluations) on N steps."""
    return [
        f"train.train_steps={steps}",
        f"train.schedule.warmup_steps={max(1, round(0.075 * steps))}",
        f"train.eval_interval={max(1, steps // 10)}",
    ]


def megatron_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    positions = batch["position_ids"]
    per_token = model(batch["tokens"], positions, None, labels=batch["labels"])
    return masked_mean(per_token, batch["loss_mask"])


def plain_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    logits = model(batch["tokens"])
    half = logits.dtype in (torch.bfloat16, torch.float16)
    logits = logits.float() if half else logits  # bf16 -> fp32; fp64 stays
    per_token = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    return masked_mean(per_token.view_as(batch["labels"]), batch["loss_mask"])


def masked_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp_min(1)


def adamw(model: torch.nn.Module, config: RunConfig) -> torch.optim.AdamW:
    """The engines' AdamW: weight decay on matrices only (norms, biases, lambda, dt spared)."""
    t = config.train
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": t.optimizer.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=t.optimizer.lr, betas=(t.optimizer.beta1, t.optimizer.beta2), eps=t.optimizer.eps
    )


def batches(dataset, config: RunConfig, start: int) -> list[Batch]:
    """The micro-batches of the global batch at sample ``start`` (one data-parallel rank)."""
    t = config.train
    indices = micro_batch_indices(start, t.global_batch_size, t.micro_batch_size, 0, 1)
    return [collate(dataset, idx) for idx in indices]


def train_step(model, optimizer, loss_fn: LossFn, micro: list[Batch], lr: float, clip: float):
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    for batch in micro:  # the mean over micro-batches, as the engines take it
        (loss_fn(model, batch) / len(micro)).backward()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


@torch.no_grad()
def validation_loss(model, loss_fn: LossFn, valid, config: RunConfig) -> float:
    """The mean loss over ``train.eval_iters`` global batches from the validation set's
    start, as the training loop's validation takes it."""
    t, losses = config.train, []
    for k in range(t.eval_iters):
        micro = batches(valid, config, k * t.global_batch_size)
        losses.append(sum(loss_fn(model, b).item() for b in micro) / len(micro))
    return sum(losses) / len(losses)


def paired_curves(config: RunConfig, datasets) -> list[tuple[int, float, float]]:
    """``(step, Megatron val. loss, plain val. loss)`` at every evaluation, the two models
    starting from the same weights and trained on the same batches."""
    from cqk_megatron.model.gpt import build_model
    from cqk_megatron.training.loop import seed_everything

    train, valid = datasets
    t = config.train
    seed_everything(config.seed)
    megatron = build_model(config)
    plain: PlainLM = plain_copy_of(megatron, config)
    models = [(megatron, megatron_loss), (plain, plain_loss)]
    optimizers = [adamw(model, config) for model, _ in models]
    curve = []
    for step in range(1, t.train_steps + 1):
        micro = batches(train, config, (step - 1) * t.global_batch_size)
        lr = learning_rate(step - 1, t)
        for (model, loss_fn), optimizer in zip(models, optimizers, strict=True):
            model.train()
            train_step(model, optimizer, loss_fn, micro, lr, t.optimizer.clip_grad)
        if step % t.eval_interval == 0 or step == t.train_steps:
            for model, _ in models:
                model.eval()
            losses = [validation_loss(model, fn, valid, config) for model, fn in models]
            curve.append((step, *losses))
    return curve


def format_curves(curves: dict[str, list[tuple[int, float, float]]]) -> str:
    """Markdown: per variant and evaluation, each model's validation perplexity and the
    plain model's difference."""
    lines = [
        "| variant | step | Megatron val. ppl | plain val. ppl | plain vs Megatron |",
        "|---|---|---|---|---|",
    ]
    for variant, curve in curves.items():
        for step, ours, plain in curve:
            difference = 100 * (math.exp(plain) / math.exp(ours) - 1)
            lines.append(
                f"| {variant} | {step} | {math.exp(ours):.2f} | {math.exp(plain):.2f} | "
                f"{difference:+.2f}% |"
            )
    return "\n".join(lines)
