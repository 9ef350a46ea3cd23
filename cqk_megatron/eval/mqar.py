"""Multi-query associative recall (MQAR): how fast each attention variant learns to recall.

    cqk mqar --variants standard,coupled --settings 64x4,128x8 --seeds 0,1,2
    cqk mqar --benchmark --out runs/mqar_benchmark      # the README's table and plot

The task is ``mqar_data.py``'s (Zoology's ``multiquery_ar``). Each run trains a small
model (``mqar_train.py``: the project's Megatron ``GPTModel``, Llama or GPT-2 family) on
fresh batches and evaluates held-out accuracy every ``--eval-every`` steps. Per variant,
family, coupling position and setting the report gives, over the seeds: the median (and
range) of the training examples needed to first reach 0.5 and 0.9 held-out accuracy,
the final accuracy (mean +- sd) and how many seeds solved the setting (reached
``SOLVED`` = 0.99; a run stops there). ``OUT/mqar_results.json`` holds every run with its
whole curve; ``OUT/mqar_curves.png`` plots accuracy against training examples, one
curve per seed. Runs are appended to ``OUT/runs.jsonl`` as they finish: the same command
again skips them.

The coupling position (``pre_rope``, ``post_rope``) varies only for variants with a
coupling in a family with RoPE; the GPT-2 family has learned positions and no RoPE.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path

from cqk_megatron.config import MODEL_FAMILIES, VARIANTS
from cqk_megatron.eval.mqar_data import (  # noqa: F401  (the task's public names)
    DEFAULT_SETTINGS,
    HARDER_SETTINGS,
    IGNORE_INDEX,
    MQARSetting,
    gap_probabilities,
    generate,
)
from cqk_megatron.eval.mqar_options import POSITIONS  # noqa: F401  (its old home)
from cqk_megatron.eval.mqar_train import (  # noqa: F401
    SOLVED,
    TrainOptions,
    accuracy,
    examples_to_reach,
    model_config,
    train_run,
)
from cqk_megatron.run.atomic import atomic_path, write_text_atomically

THRESHOLDS = (0.5, 0.9)

# The benchmark of the README, sized from the gap study (mqar_gap.py) and a pilot: with the
# width-scaled initialisation the 2-layer width-64 model solved 128x8 (vocabulary 512) in
# 500 steps of 128 sequences, and 64x4 (vocabulary 128, lr 2e-3) in 400 steps of 64. Here
# vocabulary 256, lr 2e-3, 600 steps of 64 x 64 tokens (38k examples of 64x4; 32 x 128,
# 19k examples of 128x8 and 128x16): enough for standard attention on 64x4, the edge of
# the budget on 128x8, out of reach on 128x16 (twice the pairs in the same length), and
# about 60 CPU-minutes for the whole grid (runs stop once solved). Width 64 in two heads
# of 32, so that a variant that learns faster or slower shows. Every variant on 64x4;
# standard, coupled, invertible and differential on 128x8; standard and coupled on 128x16;
# standard and coupled on 64x4 in both families and coupling positions.
BENCHMARK = {
    "seeds": [0, 1, 2],
    "grids": [  # (variants, settings, families, positions)
        (list(VARIANTS), ["64x4"], ["llama"], ["pre_rope"]),
        (["standard", "coupled", "invertible", "differential"], ["128x8"], ["llama"], ["pre_rope"]),
        (["standard", "coupled"], ["128x16"], ["llama"], ["pre_rope"]),
        (["standard", "coupled"], ["64x4"], ["llama", "gpt2"], ["pre_rope", "post_rope"]),
    ],
    "options": {
        "vocab_size": 256,  # Zoology: above the longest sequence
        "hidden_size": 64,
        "num_heads": 2,
        "num_layers": 2,
        "batch_size": 64,
        "scale_batch": True,  # 64 x 64 tokens a step: 32 x 128 on 128x8
        "steps": 600,
        "lr": 2e-3,
        "eval_every": 50,
        "eval_examples": 256,
        "stop_at": SOLVED,
    },
}


def grid(variants, settings, seeds, families, positions) -> list[dict]:
    """Every run of the benchmark: position varies only where a coupling meets RoPE."""
    runs = []
    for family in families:
        rope = MODEL_FAMILIES[family]["position_embedding_type"] == "rope"
        for setting in settings:
            for variant in variants:
                coupled = VARIANTS[variant][0] != "none"
                for position in positions if (coupled and rope) else positions[:1]:
                    for seed in seeds:
                        runs.append(
                            {
                                "family": family,
                                "setting": setting,
                                "variant": variant,
                                "position": position if (coupled and rope) else "pre_rope",
                                "seed": seed,
                            }
                        )
    return [dict(t) for t in dict.fromkeys(tuple(sorted(r.items())) for r in runs)]


def _key(run: dict) -> tuple:
    return (run["family"], run["setting"], run["variant"], run["position"], run["seed"])


def load_runs(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_grid(
    requested: list[dict], options: TrainOptions, runs_file: Path | None, log=print
) -> list[dict]:
    """Train every requested run not yet in ``runs_file`` (appending each as it finishes);
    return the results of all of them."""
    done = {_key(r): r for r in load_runs(runs_file)} if runs_file else {}
    for index, run in enumerate(requested, start=1):
        if _key(run) in done:
            continue
        run_options = TrainOptions(
            **{
                **asdict(options),
                "family": run["family"],
                "position": run["position"],
                "seed": run["seed"],
            }
        )
        setting = MQARSetting.parse(run["setting"])
        result = train_run(run["variant"], setting, run_options)
        if runs_file is not None:
            runs_file.parent.mkdir(parents=True, exist_ok=True)
            with runs_file.open("a") as handle:  # a line per run: an interruption loses one
                handle.write(json.dumps(result) + "\n")
        done[_key(run)] = result
        log(
            f"[{index}/{len(requested)}] {run['family']:<5} {run['setting']:>6} "
            f"{run['variant']:<24} {run['position']:<9} seed {run['seed']}: accuracy "
            f"{result['accuracy']:.3f} after {result['steps']} steps "
            f"({result['train_cpu_seconds']:.0f} CPU s)",
        )
    return [done[_key(p)] for p in requested]


# --- the summary ----------------------------------------------------------------------------


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (family, position, variant, setting) over its seeds."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        key = (run["family"], run["position"], run["variant"], run["setting"])
        groups.setdefault(key, []).append(run)
    rows = []
    for (family, position, variant, setting), members in groups.items():
        members.sort(key=lambda r: r["seed"])
        finals = [r["accuracy"] for r in members]
        row = {
            "family": family,
            "position": position,
            "variant": variant,
            "setting": setting,
            "seeds": [r["seed"] for r in members],
            "final_mean": statistics.mean(finals),
            "final_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "solved": sum(r["solved"] for r in members),
            "budget_examples": max(r["options"]["steps"] * r["batch_size"] for r in members),
        }
        for threshold in THRESHOLDS:
            reached = [examples_to_reach(r["curve"], threshold) for r in members]
            row[f"to_{threshold}"] = reached
            row[f"to_{threshold}_median"] = median_or_none(reached)
        rows.append(row)
    return rows


def median_or_none(values: list[int | None]) -> float | None:
    """The median with "not reached" (None) counted as beyond any budget; None when the
    median run did not reach the threshold."""
    median = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(median) else median


def _examples_cell(row: dict, threshold: float) -> str:
    reached = [v for v in row[f"to_{threshold}"] if v is not None]
    median = row[f"to_{threshold}_median"]
    if median is None:
        return f"not reached ({len(reached)}/{len(row['seeds'])})"
    spread = f"{min(reached) / 1000:.1f}k-{max(reached) / 1000:.1f}k"
    return f"{median / 1000:.1f}k ({spread})"


def format_table(rows: list[dict]) -> str:
    """Markdown, one row per (family, position, variant, setting)."""
    lines = [
        "| family | position | variant | setting | examples to 0.5 | examples to 0.9 | "
        "final accuracy | solved |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['family']} | {row['position']} | {row['variant']} | {row['setting']} | "
            f"{_examples_cell(row, 0.5)} | {_examples_cell(row, 0.9)} | "
            f"{row['final_mean']:.3f} ± {row['final_sd']:.3f} | "
            f"{row['solved']}/{len(row['seeds'])} |"
        )
    return "\n".join(lines)


# --- the plot -------------------------------------------------------------------------------


def plot_curves(runs: list[dict], path: Path) -> None:
    """Held-out accuracy against training examples: a panel per setting and family/position,
    a colour per variant, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(r["setting"] for r in runs))
    columns = list(dict.fromkeys((r["family"], r["position"]) for r in runs))
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    colours = {v: plt.get_cmap("tab10")(i % 10) for i, v in enumerate(variants)}
    fig, axes = plt.subplots(
        len(settings),
        len(columns),
        figsize=(4.6 * len(columns) + 1.5, 3.2 * len(settings)),
        dpi=110,
        squeeze=False,
        sharey=True,
    )
    for i, setting in enumerate(settings):
        for j, (family, position) in enumerate(columns):
            ax = axes[i][j]
            for run in runs:
                if (run["setting"], run["family"], run["position"]) != (setting, family, position):
                    continue
                xs = [p["examples"] for p in run["curve"]]
                ys = [p["accuracy"] for p in run["curve"]]
                ax.plot(xs, ys, color=colours[run["variant"]], lw=1.0, alpha=0.85)
            ax.set_title(f"{setting} ({family}, {position})", fontsize=9)
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            if i == len(settings) - 1:
                ax.set_xlabel("training examples")
            if j == 0:
                ax.set_ylabel("held-out accuracy")
    handles = [plt.Line2D([], [], color=colours[v], label=v) for v in variants]
    fig.legend(handles=handles, loc="center right", fontsize=8, frameon=False)
    fig.suptitle("MQAR: held-out recall accuracy vs training examples (one line per seed)")
    fig.tight_layout(rect=(0, 0, 1 - 1.4 / (4.6 * len(columns) + 1.5), 0.96))
    with atomic_path(path) as temporary:
        fig.savefig(temporary, format="png")
    plt.close(fig)


# --- the command ----------------------------------------------------------------------------


def _csv(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def _gather_shards(out: Path) -> None:
    """Append the shards' runs (``runs.shard*.jsonl``) that ``runs.jsonl`` lacks."""
    runs_file = out / "runs.jsonl"
    have = {_key(r) for r in load_runs(runs_file)}
    new = []
    for shard_file in sorted(out.glob("runs.shard*.jsonl")):
        for run in load_runs(shard_file):
            if _key(run) not in have:
                have.add(_key(run))
                new.append(run)
    if new:
        with runs_file.open("a") as handle:
            handle.writelines(json.dumps(run) + "\n" for run in new)


def benchmark_runs(seeds: list[int]) -> list[dict]:
    """Every run of ``BENCHMARK``'s grids with these seeds, each once."""
    requested = [
        run
        for variants, settings, families, positions in BENCHMARK["grids"]
        for run in grid(variants, settings, seeds, families, positions)
    ]
    return [dict(t) for t in dict.fromkeys(tuple(sorted(p.items())) for p in requested)]


def write_results(
    out: Path, options: TrainOptions, runs: list[dict], rows: list[dict], wall: float
) -> None:
    """``OUT/mqar_results.json`` (every run with its curve), ``mqar_results.md`` (the
    table) and ``mqar_curves.png``."""
    payload = {
        "options": asdict(options),
        "wall_seconds_this_invocation": wall,
        "cpu_seconds_all_runs": sum(r["train_cpu_seconds"] for r in runs),
        "summary": rows,
        "runs": runs,
    }
    write_text_atomically(out / "mqar_results.json", json.dumps(payload, indent=1))
    write_text_atomically(out / "mqar_results.md", format_table(rows) + "\n")
    plot_curves(runs, out / "mqar_curves.png")
