"""The planner's memory of the buffers an engine allocates (perf/memory.py
``model_state_bytes`` and ``engine_buffer_bytes``), against what a tiny run of the real
engine holds on 2 gloo ranks, component by component (tests/_memory_workers.py measures:
PyTorch has no allocator statistics on CPU): DeepSpeed ZeRO-2 and ZeRO-3, Megatron's
distributed optimizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _memory_workers import measure_distopt_buffers, measure_zero2_buffers, measure_zero3_buffers
from _multiproc import run_ranks
from _training import config_for

from cqk_megatron.perf.memory import (
    engine_buffer_bytes,
    model_state_bytes,
    zero3_persistent_parameters,
)

# bf16 ZeRO-2 with overlap_comm, as the 1B run trained before; 4 micro-batches a rank
ZERO2 = [
    "train.precision=bf16",
    "train.engine=deepspeed",
    "train.zero_stage=2",
    "train.overlap_grad_reduce=true",
    "train.train_steps=2",
    "train.checkpoint.save_interval=1000",
    "train.resilience.check_replicas_interval=0",
    "train.global_batch_size=16",
]
# Megatron's distributed optimizer with overlap_grad_reduce, as the 1B run trains
DISTOPT = [*ZERO2[:1], "train.engine=megatron", *ZERO2[3:]]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("engine-memory")
    run_ranks(measure_zero2_buffers, 2, str(root), ZERO2)
    return json.loads((root / "measured_0.json").read_text())


def test_zero2_buffers_match_the_planner_per_component(measured):
    n, dp, bucket = measured["count"], measured["dp"], measured["bucket"]
    assert n > 4 * bucket  # several buckets a backward, as at the shipped sizes
    estimate = model_state_bytes(n, "bf16", "zero2", dp)
    largest = measured["largest"]  # the fused gate/up matrix, reduced on its own
    assert largest > bucket
    estimate |= engine_buffer_bytes(n, "bf16", "zero2", bucket, True, largest_parameter=largest)
    for part in ("parameters", "gradients", "optimizer", "reduce_buckets", "reduction_copy"):
        assert measured[part] == pytest.approx(estimate[part], rel=0.10), (
            f"{part}: measured {measured[part]:,} B, planner {estimate[part]:,.0f} B"
        )


@pytest.fixture(scope="module")
def measured_distopt(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("engine-memory-distopt")
    run_ranks(measure_distopt_buffers, 2, str(root), DISTOPT)
    return json.loads((root / "distopt_0.json").read_text())


def test_distributed_optimizer_buffers_match_the_planner_per_component(measured_distopt):
    # the bf16 parameter buffer, the fp32 gradient buffer (whole on every rank: it is
    # reduce-scattered in place) and the fp32 master and moments of this rank's shard
    n = measured_distopt["count"]
    estimate = model_state_bytes(n, "bf16", "distopt", 2)
    assert engine_buffer_bytes(n, "bf16", "distopt", n // 8, True) == {
        "reduce_buckets": 0.0,
        "reduction_copy": 0.0,
    }
    for part in ("parameters", "gradients", "optimizer"):
        assert measured_distopt[part] == pytest.approx(estimate[part], rel=0.10), (
            f"{part}: measured {measured_distopt[part]:,} B, planner {estimate[part]:,.0f} B"
        )


# bf16 ZeRO-3 as the engine configures it, on a model whose matrices are above DeepSpeed's
# persistence threshold (1e5 elements: hidden 256, vocabulary 1024), so ZeRO-3 really
# partitions and gathers them; 4 layers, so the gather window (one bucket, 1/8 of the
# model) spans several of them, as it does at the shipped sizes.
ZERO3 = [
    *ZERO2[:2],
    "train.zero_stage=3",
    *ZERO2[3:],
    "model.hidden_size=256",
    "model.vocab_size=1024",
    "model.num_layers=4",
]


@pytest.fixture(scope="module")
def measured_zero3(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("engine-memory-zero3")
    run_ranks(measure_zero3_buffers, 2, str(root), ZERO3)
    return json.loads((root / "zero3_0.json").read_text())


def test_zero3_buffers_match_the_planner_per_component(measured_zero3, tmp_path):
    """Partitions (bf16 parameters, fp32 gradients, master weights and moments), the fp32
    reduce bucket and the concatenated copy reduced from it, the whole parameters gathered
    while the model computes and those kept whole for good."""
    m = measured_zero3
    n, dp, bucket, largest = m["count"], m["dp"], m["bucket"], m["largest"]
    assert n > 4 * bucket  # several buckets a backward, as at the shipped sizes
    persistent = zero3_persistent_parameters(config_for(str(tmp_path), "zero3", ZERO3))
    assert persistent == m["persistent_count"]
    assert 0 < persistent < n / 4  # most of the model is partitioned
    estimate = model_state_bytes(n, "bf16", "zero3", dp)
    estimate |= engine_buffer_bytes(n, "bf16", "zero3", bucket, True, largest, persistent)
    parts = ("parameters", "gradients", "optimizer", "reduce_buckets", "reduction_copy")
    for part in (*parts, "gathered_parameters", "persistent_parameters"):
        assert m[part] == pytest.approx(estimate[part], rel=0.10), (
            f"{part}: measured {m[part]:,} B, planner {estimate[part]:,.0f} B"
        )
    # DeepSpeed's defaults keep every partitioned parameter gathered from its forward to its
    # backward at these sizes: the whole bf16 model
    assert m["gathered_parameters"] == pytest.approx((n - persistent) * 2, rel=0.10)


MODEL_1B = Path(__file__).resolve().parent.parent / "configs/models/1b.yaml"


def test_the_planner_shows_zero3_buffers_where_a_layout_uses_stage_3():
    """``cqk plan`` (``perf/fit.py``): a ZeRO-3 layout's stages carry the whole parameters it
    gathers and keeps beside its partitions, as ``engine_buffer_bytes`` counts them, in its
    table and its one-line summary; a ZeRO-2 layout has no such parts."""
    from cqk_megatron.config import load_config
    from cqk_megatron.perf import fit
    from cqk_megatron.perf.traffic import reduce_bucket_elements

    base = ["train.precision=bf16", "train.engine=deepspeed", "train.micro_batch_size=1"]
    zero3 = load_config(MODEL_1B, [*base, "train.zero_stage=3"])
    result = fit.check_fits(zero3, 8, 80 * 2**30)
    stage = result.worst
    n = stage.parameters
    buffers = engine_buffer_bytes(
        n,
        "bf16",
        "zero3",
        reduce_bucket_elements(n, 8),
        False,
        fit.largest_parameter(zero3, 1, True),
        zero3_persistent_parameters(zero3),
    )
    assert stage.parts["gathered"] == buffers["gathered_parameters"] > 0
    assert stage.parts["persistent"] == buffers["persistent_parameters"] > 0
    assert stage.parts["buffers"] == buffers["reduce_buckets"]
    assert "gathered" in fit.format_stages(result) and "persistent" in fit.format_stages(result)
    assert "gathered 1.8 GiB" in result.message  # the whole bf16 rank: DeepSpeed's defaults
    zero2 = load_config(MODEL_1B, [*base, "train.zero_stage=2"])
    assert "gathered" not in fit.check_fits(zero2, 8, 80 * 2**30).worst.parts


def test_plan_explain_prints_the_zero3_buffers_of_each_ranked_layout(capsys):
    from cqk_megatron.cli import plan as plan_cli
    from cqk_megatron.config import CONFIGS_DIR

    argv = ["--config", str(CONFIGS_DIR / "runs/1b_4x8.yaml"), "--no-build-check"]
    argv += ["--profile", str(CONFIGS_DIR / "clusters/example_h100.yaml"), "--explain"]
    assert plan_cli.main([*argv, "--tp", "1", "--zero", "3"]) == 0
    ranked = capsys.readouterr().out.split("fastest first")[1]
    (memory,) = [line for line in ranked.splitlines() if line.strip().startswith("memory")]
    assert "gathered" in memory and "persistent" in memory and "buffers" in memory
