"""Why does the project's coupled model fall behind on MQAR where an independent one
pulls ahead? One difference at a time between the two setups.

    cqk mqar gap --rungs project,independent --seeds 0,1,2 \\
        --out runs/mqar_gap/runs.jsonl            # appends one JSON line per run
    cqk mqar gap --report runs/mqar_gap/runs.jsonl

Both setups train on 128x8 (vocabulary 512, width 64, one head of 64, two layers) for
2,500 steps of 128 sequences, evaluating 512 held-out sequences every 100 steps.

- ``project``: the project's Megatron model, Llama family (RoPE, RMSNorm, SwiGLU, no
  biases, coupling before RoPE, ``f`` without an output bias, ``dt = softplus(raw)``,
  N(0, 0.02) initialisation), fresh batches, AdamW (0.9, 0.98) without weight decay,
  warmup-stable-decay schedule.
- ``independent``: the plain-PyTorch ``PlainLM``, the independent small model (leapfrog before
  RoPE, ``f`` a 64-64-64 SiLU MLP with biases, ``dt = exp(log_dt)`` from 0.1, LayerNorm, a
  GELU MLP), AdamW at 1e-3 with weight decay 0.1 on every parameter (``log_dt``
  included) and torch's ``OneCycleLR``, a fixed set of 20k training examples. What the
  issue leaves open is filled in with plain PyTorch defaults: biases in every projection,
  PyTorch's default initialisation, AdamW's default betas (0.9, 0.999), gradient clipping
  at 1.0 as in the project.

The rungs in between move one group of differences at a time (``RUNGS``): ``p+X`` is
the project's setup with one difference X of the independent one, ``i-X`` the independent
setup without X, and ``p+torch_init``, ``c2``, ``c3``, ``c4``, ``i-fixed_set``,
``independent`` a ladder that adds
one difference a rung. Each rung is its options, so a new one is one line.

What it found (README, "MQAR"): the gap was the initialisation. The MQAR model took the
project's N(0, 0.02), GPT-2's scale for width 768, at width 64; ``p+torch_init_megatron``
(PyTorch's defaults redrawn into the Megatron model) learns like the plain model with the
same initialisation, and ``p+init_std_0.072`` solves 128x8 at step 500. The MQAR model
now starts at ``mqar_train.width_init_std``; the ``project`` rung keeps 0.02 to show the
gap. ``--stop-after 1000`` cuts a probe there (the schedule still spans 2,500 steps).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from cqk_megatron.eval.mqar_data import MQARSetting
from cqk_megatron.eval.mqar_train import TrainOptions, train_run
from cqk_megatron.eval.plain_model import PROJECT_FIELDS

SETTING = MQARSetting(128, 8)
BASE = dict(
    vocab_size=512,
    hidden_size=64,
    num_layers=2,
    num_heads=1,
    steps=2500,
    batch_size=128,
    lr=1e-3,
    eval_every=100,
    eval_examples=512,
    stop_at=0.99,
)
# The project's model as the issue ran it: N(0, 0.02) whatever the width (before
# mqar_train.width_init_std).
PROJECT = dict(model="megatron", family="llama", init_std=0.02)
# The project's architecture in the plain model (same function, same initial law).
INDEPENDENT_MODEL = dict(
    norm="layernorm",
    mlp="gelu",
    bias=True,
    positions="rope",
    f_output_bias=True,
    dt_param="exp",
    init="torch",
)
INDEPENDENT_REGIME = dict(train_examples=20_000)
INDEPENDENT_OPTIMIZER = dict(
    weight_decay=0.1, decay_dt=True, schedule="onecycle", adam_beta1=0.9, adam_beta2=0.999
)


def _plain(**model) -> dict:
    return {"model": "plain", "plain": {**PROJECT_FIELDS, **model}}


# name -> (what differs from the project, TrainOptions fields over BASE)
RUNGS: dict[str, tuple[str, dict]] = {
    "project": ("the project's setup as the issue ran it (Megatron model, N(0, 0.02))", PROJECT),
    "project_plain": ("the project's setup in the plain model", _plain()),
    "independent": (
        "the independent setup",
        {**_plain(**INDEPENDENT_MODEL), **INDEPENDENT_REGIME, **INDEPENDENT_OPTIMIZER},
    ),
    "independent_learned": (
        "the independent setup, learned positions",
        {
            **_plain(**{**INDEPENDENT_MODEL, "positions": "learned"}),
            **INDEPENDENT_REGIME,
            **INDEPENDENT_OPTIMIZER,
        },
    ),
    # one difference at a time from the project's setup
    "p+fixed_set": ("project + a fixed set of 20k examples", {**PROJECT, **INDEPENDENT_REGIME}),
    "p+optimizer": (
        "project + weight decay 0.1 (dt too), one-cycle, betas (0.9, 0.999)",
        {**PROJECT, **INDEPENDENT_OPTIMIZER},
    ),
    "p+regime+optimizer": (
        "project + fixed set + the independent optimiser",
        {**PROJECT, **INDEPENDENT_REGIME, **INDEPENDENT_OPTIMIZER},
    ),
    "p+ln_gelu_bias": (
        "project + LayerNorm, GELU MLP, biases (RoPE kept)",
        {
            **PROJECT,
            "megatron": [
                "model.family=null",
                "model.normalization=LayerNorm",
                "model.swiglu=false",
                "model.add_bias_linear=true",
            ],
        },
    ),
    "p+learned_positions": (
        "project + learned absolute positions",
        {
            **PROJECT,
            "megatron": ["model.family=null", "model.position_embedding_type=learned_absolute"],
        },
    ),
    # the independent architecture's parts one at a time, under the project's N(0, 0.02)
    "p+layernorm": ("project (plain) + LayerNorm", _plain(norm="layernorm")),
    "p+gelu": ("project (plain) + a GELU MLP", _plain(mlp="gelu")),
    "p+biases": ("project (plain) + biases in every projection", _plain(bias=True)),
    "p+ln_gelu_bias_plain": (
        "project (plain) + LayerNorm, GELU MLP, biases",
        _plain(norm="layernorm", mlp="gelu", bias=True),
    ),
    "p+init_std_0.072+learned": (
        "p+init_std_0.072 with learned absolute positions",
        {
            **PROJECT,
            "init_std": 0.072,
            "megatron": ["model.family=null", "model.position_embedding_type=learned_absolute"],
        },
    ),
    "p+gpt2_family": ("project in the GPT-2 family", {**PROJECT, "family": "gpt2"}),
    "p+f_bias": ("project (plain) + an output bias in f", _plain(f_output_bias=True)),
    "p+exp_dt": ("project (plain) + dt = exp(log_dt)", _plain(dt_param="exp")),
    "p+torch_init": ("project (plain) + PyTorch's default initialisation", _plain(init="torch")),
    # the Megatron model with PyTorch's default initialisation, whole or in part
    "p+torch_init_megatron": (
        "project + PyTorch's default initialisation",
        {**PROJECT, "reinit": "torch"},
    ),
    "p+init_std_0.072": (
        "project + model.init_method_std=0.072 (PyTorch's linear std at fan-in 64) for 0.02",
        {**PROJECT, "init_std": 0.072},
    ),
    "p+torch_embeddings": (
        "project + embeddings N(0, 1) (PyTorch's default), the rest N(0, 0.02)",
        {**PROJECT, "reinit": "torch_embeddings"},
    ),
    "p+torch_linears": (
        "project + linear layers U(+-1/sqrt(fan_in)) (PyTorch's), embeddings N(0, 0.02)",
        {**PROJECT, "reinit": "torch_linears"},
    ),
    # cumulative, from the project's setup to the independent one, a difference a rung
    "c2+ln_gelu_bias": (
        "p+torch_init + LayerNorm, GELU MLP, biases",
        _plain(init="torch", norm="layernorm", mlp="gelu", bias=True),
    ),
    "c3+f_bias": (
        "c2 + an output bias in f",
        _plain(init="torch", norm="layernorm", mlp="gelu", bias=True, f_output_bias=True),
    ),
    "c4+exp_dt": ("c3 + dt = exp(log_dt)", _plain(**INDEPENDENT_MODEL)),
    # c4 + the independent optimiser is i-fixed_set; + the fixed set, the independent setup
    "i-torch_init": (
        "independent with the project's N(0, 0.02) initialisation",
        {
            **_plain(**{**INDEPENDENT_MODEL, "init": "gpt2"}),
            **INDEPENDENT_REGIME,
            **INDEPENDENT_OPTIMIZER,
        },
    ),
    "i-fixed_set": (
        "independent with fresh batches",
        {**_plain(**INDEPENDENT_MODEL), **INDEPENDENT_OPTIMIZER},
    ),
    "i-optimizer": (
        "independent with the project's optimiser",
        {**_plain(**INDEPENDENT_MODEL), **INDEPENDENT_REGIME},
    ),
}
VARIANTS = ("standard", "coupled")


def rung_options(rung: str, seed: int, **overrides) -> TrainOptions:
    if rung not in RUNGS:
        raise ValueError(f"unknown rung {rung!r}; choose from {list(RUNGS)}")
    return TrainOptions(**{**BASE, **RUNGS[rung][1], "seed": seed, **overrides})


def _done(path: Path) -> set[tuple[str, str, int]]:
    if not path.exists():
        return set()
    keys = set()
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            keys.add((record["rung"], record["variant"], record["seed"]))
    return keys


def run(rungs: list[str], variants: list[str], seeds: list[int], out: Path, **overrides) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    for seed in seeds:  # seeds outermost: every rung gets a first seed early
        for rung in rungs:
            for variant in variants:
                if (rung, variant, seed) in _done(out):
                    continue
                print(f"{rung} {variant} seed {seed}: {RUNGS[rung][0]}", flush=True)
                result = train_run(
                    variant, SETTING, rung_options(rung, seed, **overrides), log=print
                )
                result["rung"] = rung
                with out.open("a") as handle:  # one line per run: a crash loses one run
                    handle.write(json.dumps(result) + "\n")
                print(
                    f"{rung} {variant} seed {seed}: accuracy {result['accuracy']:.3f} "
                    f"({result['steps']} steps, {result['train_cpu_seconds']:.0f} CPU s)",
                    flush=True,
                )


def _fmt_examples(values: list[int | None], total: int) -> str:
    reached = sorted(v for v in values if v is not None)
    if len(reached) * 2 <= len(values):  # the median is "not reached"
        return f"> {total:,} ({len(reached)}/{len(values)})"
    median = statistics.median([v if v is not None else float("inf") for v in values])
    return f"{median:,.0f} ({min(reached):,}-{max(reached):,})"


COMPARE_AT = 1000  # the step every run of the table is compared at (probes stop there)


def accuracy_at(run: dict, step: int) -> float:
    """Held-out accuracy at the last evaluation up to ``step``; a run that stopped earlier
    because it had solved the task keeps its final accuracy."""
    points = [p for p in run["curve"] if p["step"] <= step]
    return points[-1]["accuracy"] if points else float("nan")


def _budget(run: dict) -> int:
    options = run["options"]
    return min(options["steps"], options.get("stop_after") or options["steps"]) * run["batch_size"]


def report(records: list[dict]) -> str:
    """Markdown: one row per rung and variant, in ``RUNGS`` order."""
    lines = [
        f"| rung | what differs | variant | seeds | accuracy at step {COMPARE_AT:,} (per seed) | "
        "final accuracy (steps run) | examples to 0.9 (median, range) | solved |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rung, (description, _) in RUNGS.items():
        for variant in VARIANTS:
            runs = sorted(
                (r for r in records if r["rung"] == rung and r["variant"] == variant),
                key=lambda r: r["seed"],
            )
            if not runs:
                continue
            at = [accuracy_at(r, COMPARE_AT) for r in runs]
            finals = ", ".join(f"{r['accuracy']:.2f} ({r['steps']})" for r in runs)
            budget = max(_budget(r) for r in runs)
            lines.append(
                f"| {rung} | {description} | {variant} | {len(runs)} | "
                f"{statistics.mean(at):.3f} ("
                + ", ".join(f"{a:.2f}" for a in at)
                + f") | {finals} | "
                f"{_fmt_examples([r['examples_to_0.9'] for r in runs], budget)} | "
                f"{sum(r['solved'] for r in runs)}/{len(runs)} |"
            )
    return "\n".join(lines)
