"""Activation recompute (``train.recompute``) and the planner that offers it.

- For every variant (and a post-RoPE coupling, whose coupling runs inside the recomputed
  core attention), the loss and every gradient with selective and full recompute equal
  those without, in fp32 to 1e-6, and the recompute did run (the core attention's forward
  is called again in the backward).
- The planner (``cqk-plan``) offers exactly what training accepts: every layout it prints
  as fitting, run as the overrides it prints, passes ``validate``; its memory model of
  ``recompute_method`` / ``recompute_num_layers`` follows Megatron-Core's.
"""

from __future__ import annotations

import re

import pytest
import torch

from cqk_megatron.cli import plan as plan_cli
from cqk_megatron.config import (
    CONFIGS_DIR,
    RECOMPUTE,
    RECOMPUTE_METHODS,
    VARIANTS,
    ConfigError,
    load_config,
    validate,
)
from cqk_megatron.model.gpt import build_model
from cqk_megatron.parallel.process_groups import init_single_process
from cqk_megatron.perf import fit as plan
from cqk_megatron.perf import memory

TINY = [
    "model.vocab_size=128",
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=16",
]
RECOMPUTES = {
    "selective": ["train.recompute=selective"],
    "full-uniform-1": ["train.recompute=full"],
    "full-uniform-2": ["train.recompute=full", "train.recompute_num_layers=2"],
    "full-block-3": [
        "train.recompute=full",
        "train.recompute_method=block",
        "train.recompute_num_layers=3",
    ],
}
# core attention forwards per step of 4 layers: each recomputed layer's runs twice
EXPECTED_CALLS = {
    "none": 4,
    "selective": 8,
    "full-uniform-1": 8,
    "full-uniform-2": 8,
    "full-block-3": 7,
}
CASES = {
    name: [f"attention.coupling={c}", f"attention.scoring={s}"] for name, (c, s) in VARIANTS.items()
}
CASES["coupled-post-rope"] = [*CASES["coupled"], "attention.position=post_rope"]
CASES["coupled-gqa"] = [*CASES["coupled"], "model.num_query_groups=2"]


def _step(overrides: list[str]) -> tuple[float, dict[str, torch.Tensor], int]:
    """Loss, gradients and core-attention forward calls of one training step."""
    config = validate(load_config(None, [*TINY, *overrides]))
    torch.manual_seed(0)
    model = build_model(config)
    model.train()
    calls = [0]

    def count(*_):
        calls[0] += 1

    for layer in model.decoder.layers:
        layer.self_attention.core_attention.register_forward_hook(count)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, 16)
    loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return loss.item(), grads, calls[0]


@pytest.fixture(scope="module")
def world():
    init_single_process(load_config(None, TINY))


@pytest.mark.parametrize("case", list(CASES))
def test_recompute_gives_the_same_loss_and_gradients(world, case):
    reference_loss, reference_grads, calls = _step(CASES[case])
    assert calls == EXPECTED_CALLS["none"]
    for name, overrides in RECOMPUTES.items():
        loss, grads, calls = _step([*CASES[case], *overrides])
        assert calls == EXPECTED_CALLS[name], (name, calls)  # it did recompute
        assert abs(loss - reference_loss) <= 1e-6 * abs(reference_loss), name
        assert grads.keys() == reference_grads.keys()
        for parameter, grad in grads.items():
            expected = reference_grads[parameter]
            scale = expected.abs().max().clamp_min(1e-12)
            assert (grad - expected).abs().max() <= 1e-6 * scale, (name, parameter)


# -- validation ------------------------------------------------------------------------


def test_the_planner_and_training_share_the_recompute_choices():
    assert memory.RECOMPUTE is RECOMPUTE and memory.RECOMPUTE_METHODS is RECOMPUTE_METHODS


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["train.recompute=everything"], "train.recompute"),
        (["train.recompute=full", "train.recompute_method=random"], "train.recompute_method"),
        (["train.recompute=selective", "train.recompute_num_layers=2"], "applies to"),
        (["train.recompute=full", "train.recompute_num_layers=3"], "must divide"),
        (
            [
                "train.recompute=full",
                "train.recompute_method=block",
                "train.recompute_num_layers=5",
            ],
            "at most 4",
        ),
        (
            [
                "parallel.pipeline_parallel=2",
                "train.recompute=full",
                "train.recompute_method=block",
                "train.recompute_num_layers=3",
            ],
            "at most 2",  # per pipeline stage
        ),
    ],
)
def test_recompute_settings_that_cannot_run_are_refused(overrides, field):
    with pytest.raises(ConfigError, match=field):
        validate(load_config(None, [*TINY, *overrides]))


def test_recompute_settings_that_run_are_accepted():
    for overrides in RECOMPUTES.values():
        validate(load_config(None, [*TINY, *overrides]))


# -- the planner ---------------------------------------------------------------------------


def _activations(config, layout: plan.Layout) -> float:
    result = plan.plan_layout(config, layout, 1, 80 * plan.GIB)
    return result.worst.parts["activations"], result.worst.parts["transient"]


def test_the_memory_model_follows_megatrons_recompute_methods():
    config = load_config(CONFIGS_DIR / "models/1b.yaml", ["train.precision=bf16"])
    act = memory.activation_estimate(config, 1, recompute="full")
    layers = config.model.num_layers  # 16
    kept, rebuild = memory.stage_activation_bytes(act, layers, 1, "full")  # uniform, 1
    assert kept == layers * act.input_bytes and rebuild == act.full_layer_bytes
    kept, rebuild = memory.stage_activation_bytes(act, layers, 1, "full", "uniform", 4)
    assert kept == layers // 4 * act.input_bytes and rebuild == 4 * act.full_layer_bytes
    kept, rebuild = memory.stage_activation_bytes(act, layers, 1, "full", "block", 6)
    assert kept == 6 * act.input_bytes + 10 * act.kept_layer_bytes
    assert rebuild == act.full_layer_bytes
    # block without a count recomputes every layer: uniform's numbers
    assert memory.stage_activation_bytes(act, layers, 1, "full", "block") == (
        memory.stage_activation_bytes(act, layers, 1, "full")
    )
    # with 2 virtual chunks of 8 layers, block 6 counts per chunk
    kept, _ = memory.stage_activation_bytes(act, layers, 2, "full", "block", 6)
    assert kept == 2 * (6 * act.input_bytes + 2 * act.kept_layer_bytes)
    none = memory.activation_estimate(config, 1)
    assert act.kept_layer_bytes == none.layer_bytes == none.kept_layer_bytes


def test_selective_recompute_also_drops_a_post_rope_coupling():
    pre = load_config(CONFIGS_DIR / "models/1b.yaml", ["attention.coupling=hamiltonian"])
    post = load_config(
        CONFIGS_DIR / "models/1b.yaml",
        ["attention.coupling=hamiltonian", "attention.position=post_rope"],
    )
    coupling = memory.activation_estimate(pre, 1).per_layer["coupling"]
    saved = (
        memory.activation_estimate(pre, 1, recompute="selective").layer_bytes
        - memory.activation_estimate(post, 1, recompute="selective").layer_bytes
    )
    assert coupling > 0 and saved == pytest.approx(coupling)


def test_check_fits_reads_the_recompute_settings_of_the_config():
    base = ["train.precision=bf16", "train.micro_batch_size=4", "train.global_batch_size=32"]
    config = load_config(CONFIGS_DIR / "models/1b.yaml", base)
    none = plan.check_fits(config, 8, 80 * plan.GIB).worst.parts["activations"]
    block = load_config(
        CONFIGS_DIR / "models/1b.yaml",
        [
            *base,
            "train.recompute=full",
            "train.recompute_method=block",
            "train.recompute_num_layers=8",
        ],
    )
    half = plan.check_fits(block, 8, 80 * plan.GIB)
    assert half.layout.recompute_label() == "full/block/8"
    assert none * 0.4 < half.worst.parts["activations"] < none * 0.7


RUN = re.compile(re.escape(plan.RUN_PREFIX) + r"(.*)")
FIT = re.compile(r"(\d+) of (\d+) layouts fit")


@pytest.mark.parametrize(
    ("config", "gpus", "options"),
    [
        ("configs/models/1b.yaml", 8, ["--recompute", "all"]),
        ("configs/models/7b.yaml", 64, ["--recompute", "all", "--micro-batch", "2"]),
        (
            "configs/models/350m.yaml",
            16,
            ["--variant", "coupled_differential", "--recompute", "full"]
            + [
                "--recompute-method",
                "block",
                "--recompute-num-layers",
                "2",
                "--global-batch",
                "64",
            ],
        ),
        ("configs/runs/1b_4x8.yaml", 32, ["--micro-batch", "4", "--recompute", "all"]),
        ("configs/models/3b.yaml", 8, ["--gpu-mem", "40GiB", "--recompute", "all", "--all"]),
    ],
)
def test_every_layout_the_planner_prints_as_fitting_passes_validate(capsys, config, gpus, options):
    argv = ["--config", config, "--gpus", str(gpus), "--show-overrides", "--no-build-check"]
    plan_cli.main([*argv, *options])
    out = capsys.readouterr().out
    fitting = int(FIT.search(out)[1])
    runs = [match[1].split() for match in RUN.finditer(out)]
    assert fitting > 0 and len(runs) == fitting, out[-2000:]
    extra = []
    if "--variant" in options:
        extra = [
            f"attention.coupling={VARIANTS['coupled_differential'][0]}",
            "attention.scoring=differential",
        ]
    for overrides in runs:
        validate(load_config(CONFIGS_DIR.parent / config, [*extra, *overrides]), gpus)


def test_layouts_training_refuses_are_not_offered():
    # differential attention with 8 query-group heads: TP=8 leaves one per rank (odd)
    config = load_config(
        CONFIGS_DIR / "models/1b.yaml",
        ["attention.scoring=differential", "model.num_query_groups=8"],
    )
    offered = plan.enumerate_layouts(config, 8, recomputes=RECOMPUTE)
    assert offered and all(layout.tp < 8 for layout in offered)
    # a global batch that DP=8 cannot split: only layouts with DP dividing it
    offered = plan.enumerate_layouts(config, 8, micro_batch=1, global_batch=12)
    assert offered and all(12 % layout.dp == 0 for layout in offered)
    with pytest.raises(SystemExit):
        plan_cli.main(["--config", "configs/models/1b.yaml", "--gpus", "8", "--zero", "0"])
