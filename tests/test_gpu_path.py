"""What a first GPU run needs, checked on CPU in real runs of the training loop (gloo):

- sequence parallelism with the local spec (``norm.TorchNorm``): TP=2 + SP gives the 1-rank
  loss curve and gradient norm under both engines; two planted faults show the comparison
  sees a missing TP sum of the norms' gradients (DeepSpeed) and a second one (Megatron's
  ``finalize_model_grads`` adding its own, if the norms were marked ``sequence_parallel``);
- ``train.recompute`` (selective, full with both methods) changes no number of a run;
- an audit of every collective this package calls in those runs: each is called from
  ``training/collectives.py`` (or the model's gradient hooks, ``attention/tp_grads.py``)
  with its tensors on ``device()``.

Two spawns: one rank (initial weights, both engines' references), two ranks (the rest).
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from _gpu_path_workers import audited_train_runs
from _multiproc import run_ranks
from _training import exits, records

import cqk_megatron.config.checks as config_module
from cqk_megatron.config import CONFIGS_DIR, ConfigError, load_config, validate
from cqk_megatron.perf.flops import peak_flops

STEPS = 8
COUPLED_DIFFERENTIAL = ["attention.coupling=hamiltonian", "attention.scoring=differential"]
SP = ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"]
MEGATRON = ["train.engine=megatron"]
SELECTIVE = ["train.recompute=selective"]
FULL_BLOCK = [
    "train.recompute=full",
    "train.recompute_method=block",
    "train.recompute_num_layers=1",
]
FULL_UNIFORM = ["train.recompute=full", "train.recompute_method=uniform"]
LOSS_TOLERANCE, NORM_TOLERANCE = 1e-5, 1e-4  # relative, a layout against the 1-rank run
OWNERS = {"cqk_megatron/training/collectives.py", "cqk_megatron/model/attention/tp_grads.py"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpu-path")
    r = str(root)
    # Clipping at 0.5 is active (gradient norms are ~1), so the global norm must agree too.
    same = [
        *COUPLED_DIFFERENTIAL,
        "train.eval_interval=100",
        "train.checkpoint.save_interval=100",
        "train.optimizer.clip_grad=0.5",
        "train.checkpoint.hashes=false",
        f"train.train_steps={STEPS}",
        f"train.init_from={r}/init",
    ]
    one_rank = [("ref-ds", same, "none"), ("ref-mg", [*same, *MEGATRON], "none")]
    run_ranks(audited_train_runs, 1, r, [("init", COUPLED_DIFFERENTIAL)], one_rank)
    two_ranks = [
        ("ds-sp", [*same, *SP], "none"),
        ("ds-sp-selective", [*same, *SP, *SELECTIVE], "none"),
        # the replica check would stop this run at step 1 (tests/test_replicas.py shows it):
        # off, to measure how far the curve goes
        ("ds-sp-unsummed", [*same, *SP, "train.resilience.check_replicas_interval=0"], "unsummed"),
        ("mg-sp", [*same, *SP, *MEGATRON], "none"),
        ("mg-sp-full", [*same, *SP, *MEGATRON, *FULL_BLOCK], "none"),
        ("mg-sp-marked", [*same, *SP, *MEGATRON], "marked"),
        # DP=2 with full recompute, evaluating and saving: the loop's other collectives
        (
            "mg-dp2-full",
            [
                *same,
                *MEGATRON,
                *FULL_UNIFORM,
                "train.eval_interval=4",
                "train.checkpoint.save_interval=4",
            ],
            "none",
        ),
    ]
    run_ranks(audited_train_runs, 2, r, [], two_ranks)
    return root


def _curve(runs: Path, name: str) -> list[tuple[float, float]]:
    assert exits(runs, name) == ["0"], name
    return [(r["loss"], r["grad_norm"]) for r in records(runs, name, "train")]


def _worst(runs: Path, name: str, reference: str) -> tuple[float, float]:
    """Largest relative difference of the losses and of the gradient norms."""
    got, expected = _curve(runs, name), _curve(runs, reference)
    assert len(got) == len(expected) == STEPS
    loss = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(got, expected, strict=True))
    norm = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(got, expected, strict=True))
    return loss, norm


@pytest.mark.parametrize(("run", "reference"), [("ds-sp", "ref-ds"), ("mg-sp", "ref-mg")])
def test_sequence_parallel_gives_the_one_rank_run(runs, run, reference):
    loss, norm = _worst(runs, run, reference)
    assert loss <= LOSS_TOLERANCE and norm <= NORM_TOLERANCE, (loss, norm)
    curve = _curve(runs, reference)
    assert curve[-1][0] < curve[0][0] - 0.5  # and it trains
    assert all(math.isfinite(n) and n > 0 for _, n in curve)


def test_a_missing_tp_sum_of_the_norm_gradients_is_seen(runs):
    # measured: loss 1.8e-4, gradient norm 1.1e-3 off; both far past the tolerances
    loss, norm = _worst(runs, "ds-sp-unsummed", "ref-ds")
    assert loss > 5 * LOSS_TOLERANCE and norm > 5 * NORM_TOLERANCE, (loss, norm)


def test_a_second_sum_by_megatrons_finalize_is_seen(runs):
    # Adam barely notices a doubled gradient (it divides by its scale), the norm does:
    # measured 3.9e-3 off
    _, norm = _worst(runs, "mg-sp-marked", "ref-mg")
    assert norm > 5 * NORM_TOLERANCE, norm


@pytest.mark.parametrize(
    ("run", "reference", "loss_tolerance", "norm_tolerance"),
    [
        ("ds-sp-selective", "ds-sp", 1e-6, 1e-6),  # same layout: the same numbers
        ("mg-sp-full", "mg-sp", 1e-6, 1e-6),
        ("mg-dp2-full", "ref-mg", LOSS_TOLERANCE, NORM_TOLERANCE),  # and another layout
    ],
)
def test_recompute_changes_no_number_of_a_run(runs, run, reference, loss_tolerance, norm_tolerance):
    loss, norm = _worst(runs, run, reference)
    assert loss <= loss_tolerance and norm <= norm_tolerance, (loss, norm)


def _audits(runs: Path) -> list[dict]:
    paths = sorted(runs.glob("audit-*-rank*.json"))
    assert len(paths) == 3, paths  # one rank, then two
    return [json.loads(p.read_text()) for p in paths]


def test_every_collective_of_the_package_is_the_owners_on_the_device(runs):
    for audit in _audits(runs):
        for record in audit["records"]:
            assert record["caller"] in OWNERS, record
            assert record["devices"] in ("-", audit["device"]), (record, audit["device"])


def test_the_audit_saw_the_loops_collectives(runs):
    seen = {}
    for audit in _audits(runs):
        for record in audit["records"]:
            key = (record["caller"].rsplit("/", 1)[-1], record["function"])
            seen[key] = seen.get(key, 0) + record["calls"]
    # the parameter count, the stop flag and the loss every step; at each save the ranks'
    # outcomes gathered (every rank fails together) and a barrier before the weights-only
    # save; the TP sums of the replicated parameters' gradients (f, dt, lambda, norms
    # under SP)
    assert seen.get(("collectives.py", "all_reduce"), 0) >= 3 * STEPS, seen
    assert seen.get(("collectives.py", "all_gather_object"), 0) >= 3, seen
    assert seen.get(("collectives.py", "barrier"), 0) >= 1, seen
    assert seen.get(("tp_grads.py", "all_reduce"), 0) > 0, seen


# -- sequence parallelism, every variant, at the model level: with TP=2 in
# tests/test_parallel_equivalence.py::test_every_variant_matches_single_process


# -- what a GPU node gets --------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(CONFIGS_DIR.glob("runs/*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_run_config_starts_with_only_the_pinned_packages(path):
    # validate() passes on its own world size, and nothing in it needs Apex or
    # Transformer Engine (neither is pinned): the local spec, whose norms take SP
    config = load_config(path)
    validate(config, config.parallel.world_size)
    assert config.transformer_impl == "local"
    assert importlib.util.find_spec("apex") is None  # and neither is installed here
    assert "transformer_engine" not in sys.modules


def test_transformer_engine_is_refused_where_it_is_not_importable():
    assert importlib.util.find_spec("transformer_engine") is None
    refusal = "Transformer Engine is not importable.*transformer_impl=local"
    with pytest.raises(ConfigError, match=refusal):
        validate(load_config(None, ["transformer_impl=transformer_engine"]))


def test_transformer_engine_norms_under_sp_need_megatrons_engine(monkeypatch):
    # TE is not installed here: its importability is answered yes (a mock, said so)
    monkeypatch.setattr(config_module, "_transformer_engine_importable", lambda: True)
    sp = ["transformer_impl=transformer_engine", "parallel.tensor_parallel=2"]
    sp += ["model.seq_length=32", "parallel.sequence_parallel=true"]
    with pytest.raises(ConfigError, match="finalize_model_grads.*train.engine=megatron"):
        validate(load_config(None, sp))
    validate(load_config(None, [*sp, "train.engine=megatron"]))
    validate(load_config(None, ["transformer_impl=transformer_engine"]))


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),  # SXM
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),  # SXM: the name torch reports for an H200 SXM
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("Tesla V100-SXM2-32GB", None),  # unknown: no MFU rather than a wrong one
    ],
)
def test_the_mfu_peak_of_each_gpu_name(name, peak):
    assert peak_flops(name) == peak


def test_on_gpu_the_optimizer_is_torchs_fused_adamw(monkeypatch):
    # No GPU here: device() answers cuda (a mock); torch's fused AdamW also runs on CPU
    # tensors, so the optimizer is built for real. No DeepSpeed op is JIT-compiled.
    from cqk_megatron.training.engines import deepspeed as engine

    monkeypatch.setattr(engine, "device", lambda: torch.device("cuda", 0))
    model = torch.nn.Linear(4, 4)
    config = load_config(None, [])
    optimizer = engine.make_optimizer(model, config)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    offload = load_config(None, ["train.offload_optimizer=true", "train.zero_stage=2"])
    monkeypatch.setattr(engine, "_prebuilt_deepspeed_op", lambda name: False)
    host = engine.make_optimizer(model, offload)  # DeepSpeed's CPU Adam is not prebuilt
    assert type(host) is torch.optim.AdamW and not host.defaults["fused"]
    assert engine.deepspeed_config(offload, 1)["zero_force_ds_cpu_optimizer"] is False


def test_the_1b_run_overlaps_the_gradient_reduction_with_the_backward():
    # train.overlap_grad_reduce: Megatron DDP's overlap_grad_reduce (the 1B run's engine),
    # DeepSpeed ZeRO's overlap_comm (on CPU too: a DP=2 ZeRO-1 or ZeRO-2 run gave the very
    # same losses and gradient norms with it as without)
    from cqk_megatron.training.engines.deepspeed import deepspeed_config

    shipped = load_config(CONFIGS_DIR / "runs" / "1b_4x8.yaml", [])
    assert shipped.train.engine == "megatron" and shipped.train.overlap_grad_reduce
    # the 1B run's former DeepSpeed settings
    config = load_config(
        CONFIGS_DIR / "runs" / "1b_4x8.yaml", ["train.engine=deepspeed", "train.zero_stage=2"]
    )
    assert deepspeed_config(config, 8)["zero_optimization"]["overlap_comm"] is True
    plain = load_config(None, [])
    assert "overlap_comm" not in deepspeed_config(plain, 8)["zero_optimization"]
    pipelined = load_config(
        None, ["train.overlap_grad_reduce=true", "parallel.pipeline_parallel=2"]
    )
    with pytest.raises(ConfigError, match="DeepSpeed's overlap_comm reduces gradients in hooks"):
        validate(pipelined)
    # bf16 ZeRO-1 with fp32 gradient sums is DeepSpeed's BF16_Optimizer, which cannot overlap
    assert config.train.zero_stage == 2 and config.train.precision == "bf16"
    zero1 = load_config(
        None, ["train.overlap_grad_reduce=true", "train.precision=bf16", "train.zero_stage=1"]
    )
    with pytest.raises(ConfigError, match="BF16_Optimizer, which reduces after the backward"):
        validate(zero1)
