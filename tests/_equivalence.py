"""Worker for the parallel-equivalence tests: a TP x PP layout against TP=1, PP=1.

In each rank: build the reference model (TP=1, PP=1) from a seed, train it 3 steps with
Megatron's schedule and SGD, then rebuild Megatron's groups for the layout, load the
same weights into this rank's shard, train 3 steps on the same batches, and write the
largest relative differences of losses, first-step gradients and final parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from _tiny import variant_overrides
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from cqk_megatron.config import RunConfig, load_config
from cqk_megatron.model.gpt import build_model
from cqk_megatron.parallel.process_groups import DistEnv, init_model_parallel, init_process_group
from cqk_megatron.parallel.sharding import global_name, load_full_state, local_shard

SEED = 1234
STEPS = 3
MICRO_BATCHES = 4
MICRO_BATCH_SIZE = 2


def make_config(variant: str, tp: int, pp: int, overrides: list[str]) -> RunConfig:
    return load_config(
        None,
        [
            *variant_overrides(variant),  # a preset name or coupling+scoring
            f"parallel.tensor_parallel={tp}",
            f"parallel.pipeline_parallel={pp}",
            *overrides,
        ],
    )


def make_batches(config: RunConfig) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED)
    shape = (STEPS, MICRO_BATCHES, MICRO_BATCH_SIZE, config.model.seq_length + 1)
    data = torch.randint(0, config.model.vocab_size, shape, generator=generator)
    return [[data[s, m] for m in range(MICRO_BATCHES)] for s in range(STEPS)]


def forward_step(data_iterator, model):
    sample = next(data_iterator)
    tokens, labels = sample[:, :-1], sample[:, 1:]
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    output = model(tokens, positions, None, labels=labels)

    def loss_func(per_token_loss):
        loss = per_token_loss.mean()
        return loss, {"loss": loss.detach().clone()}  # the schedule divides loss in place

    return output, loss_func


def train(model, config: RunConfig, batches) -> dict:
    """3 SGD steps through Megatron's schedule; losses, first grads, last params.

    SGD with momentum, not Adam: Adam divides by sqrt(v), which turns 1e-7 rounding
    differences in near-zero gradients into lr-sized parameter differences, hiding
    real agreement. SGD keeps parameter differences proportional to gradient ones.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    schedule = get_forward_backward_func()
    losses, first_grads = [], {}
    for step_batches in batches:
        optimizer.zero_grad()
        outputs = schedule(
            forward_step_func=forward_step,
            data_iterator=iter(step_batches),
            model=model,
            num_microbatches=len(step_batches),
            seq_length=config.model.seq_length,
            micro_batch_size=MICRO_BATCH_SIZE,
            forward_only=False,
        )
        if outputs:
            losses.append(sum(o["loss"].item() for o in outputs) / len(outputs))
        if not first_grads:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": first_grads, "params": params}


def relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().clamp_min(1e-12)
    return ((actual - expected).abs().max() / scale).item()


def reference_run(variant: str, overrides: list[str]) -> tuple[dict, dict, list]:
    """The TP=1, PP=1 run: its initial weights, its results and its batches."""
    reference_config = make_config(variant, 1, 1, overrides)
    init_model_parallel(reference_config)
    torch.manual_seed(SEED)
    reference_model = build_model(reference_config)
    full_state = {n: p.detach().clone() for n, p in reference_model.named_parameters()}
    batches = make_batches(reference_config)
    return full_state, train(reference_model, reference_config, batches), batches


def compare_variant(
    variant: str,
    tp: int,
    pp: int,
    overrides: list[str],
    reference: tuple[dict, dict, list] | None = None,
    layout_overrides: tuple[str, ...] = (),
) -> dict:
    """The layout's run against the reference (run here unless given); the layout alone
    also takes ``layout_overrides`` (sequence parallelism, which TP=1 cannot have)."""
    full_state, reference, batches = reference or reference_run(variant, overrides)
    config = make_config(variant, tp, pp, [*overrides, *layout_overrides])
    init_model_parallel(config)
    model = build_model(config)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    offset = parallel_state.get_pipeline_model_parallel_rank() * (config.model.num_layers // pp)
    gated = config.model.swiglu
    load_full_state(model, full_state, offset, tp_rank, tp, gated)
    result = train(model, config, batches)

    def worst(kind: str) -> tuple[float, str]:
        diffs = {}
        for name, param in model.named_parameters():
            full = reference[kind][global_name(name, offset)]
            expected = local_shard(full, param, name, tp_rank, tp, gated)
            diffs[name] = relative_difference(result[kind][name], expected)
        name = max(diffs, key=diffs.get)
        return diffs[name], name

    grad_diff, grad_name = worst("grads")
    param_diff, param_name = worst("params")
    pairs = zip(result["losses"], reference["losses"], strict=True) if result["losses"] else []
    loss_diff = max((abs(a - b) / abs(b) for a, b in pairs), default=0.0)
    return {
        "has_loss": bool(result["losses"]),
        "losses": result["losses"],
        "reference_losses": reference["losses"],
        "loss": loss_diff,
        "grad": grad_diff,
        "grad_worst": grad_name,
        "param": param_diff,
        "param_worst": param_name,
        "num_params": len(result["params"]),
    }


SEQUENCE_PARALLEL = ("parallel.sequence_parallel=true",)


def worker(
    rank, world_size, port, tp, pp, variants, overrides, out_dir, control=None, also_sp=False
) -> None:
    """Compare ``variants``; with ``also_sp``, each once more with sequence parallelism on
    (``<variant>[sp]``, against the same reference); then, if ``control`` names a variant,
    compare it once more with the TP gradient sum of replicated parameters switched off (a
    negative control: the harness must see that difference)."""
    init_process_group(DistEnv(rank, rank, world_size, "127.0.0.1", port))
    results = {}
    for variant in variants:
        reference = reference_run(variant, overrides)
        results[variant] = compare_variant(variant, tp, pp, overrides, reference)
        if also_sp:
            results[f"{variant}[sp]"] = compare_variant(
                variant, tp, pp, overrides, reference, SEQUENCE_PARALLEL
            )
    if control is not None:
        from cqk_megatron.model.attention import coupled, differential

        coupled.sum_partial_grads_across_tp = differential.sum_partial_grads_across_tp = (
            lambda module, group: None
        )
        results[f"{control}[no-tp-grad-sum]"] = compare_variant(control, tp, pp, overrides)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
