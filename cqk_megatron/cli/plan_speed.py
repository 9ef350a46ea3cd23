"""``cqk plan --profile``: the layouts that fit, ranked by the step-time model's predicted
tokens/s/GPU, each with its time budget; and ``--sweep``, each run's predicted GPU-hours
and the sweep's total. The model is ``cqk_megatron.planner.step_time``."""

from __future__ import annotations

from cqk_megatron.config import RunConfig, load_config
from cqk_megatron.perf.fit import PlanResult, gib, memory_parts, training_config
from cqk_megatron.planner.hardware import ClusterHardware
from cqk_megatron.planner.step_time import StepPrediction, format_prediction, predict_step
from cqk_megatron.planner.sweep import expand_sweep


def rank_layouts(
    config: RunConfig,
    results: list[PlanResult],
    hardware: ClusterHardware,
    micro_batch: int,
    global_batch: int | None,
) -> list[tuple[PlanResult, StepPrediction]]:
    """The layouts that fit with their predictions, fastest first."""
    ranked = []
    for result in results:
        if result.fits:
            built = training_config(config, result.layout, micro_batch, global_batch)
            try:
                ranked.append((result, predict_step(built, hardware)))
            except ValueError as error:  # a setting the model does not price
                print(f"{result.layout.describe()}: not ranked: {error}")
    ranked.sort(key=lambda pair: -pair[1].tokens_per_s_per_gpu)
    return ranked


def format_ranking(ranked: list[tuple[PlanResult, StepPrediction]], explain: bool) -> str:
    lines = [
        f"{'rank':>4} {'layout':<44} {'memory':>9} {'step ms':>8} {'compute':>8} "
        f"{'comm':>7} {'bubble':>7} {'tok/s/GPU':>10} {'MFU':>6}"
    ]
    for place, (result, p) in enumerate(ranked, 1):
        parts = p.parts
        comm = parts["tp_pp_in_line"] + parts["dp_exposed"] + parts["step_end_sums"]
        lines.append(
            f"{place:>4} {result.layout.describe():<44} {gib(result.worst.total):>9} "
            f"{p.step_s * 1e3:>8.1f} {parts['compute'] * 1e3:>8.1f} {comm * 1e3:>7.1f} "
            f"{parts['pipeline_bubble'] * 1e3:>7.1f} {p.tokens_per_s_per_gpu:>10,.0f} "
            f"{p.mfu:>6.1%}"
        )
        if explain:
            lines.append(format_prediction(p))
            lines.append(f"  memory, stage {result.worst.stage}: {memory_parts(result.worst)}")
    lines.append(
        "(predicted by the step-time model: docs/performance.md; comm is what the step "
        "waits for, the overlapped part left out)"
    )
    return "\n".join(lines)


def sweep_config(run: dict) -> RunConfig:
    """One expanded sweep run as the training config it launches, on its world size."""
    world = run["resources"]["world_size"]
    return load_config(run["config"], [*run["overrides"], f"parallel.world_size={world}"])


def format_sweep_hours(path: str, hardware: ClusterHardware) -> str:
    """Each run's predicted step, MFU and GPU-hours, and the sweep's total."""
    lines = [f"{'run':<40} {'GPUs':>5} {'steps':>7} {'step s':>7} {'MFU':>6} {'GPU-hours':>10}"]
    total = 0.0
    for run in expand_sweep(path):
        prediction = predict_step(sweep_config(run), hardware)
        steps = run["schedule"]["train_steps"]
        hours = prediction.gpu_hours(steps)
        total += hours
        lines.append(
            f"{run['name']:<40} {prediction.world_size:>5} {steps:>7} "
            f"{prediction.step_s:>7.2f} {prediction.mfu:>6.1%} {hours:>10,.1f}"
        )
    lines.append(f"total: {total:,.0f} GPU-hours on {hardware.gpu} (predicted, no restarts)")
    return "\n".join(lines)
