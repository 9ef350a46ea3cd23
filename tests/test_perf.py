"""FLOPs, MFU, the memory planner and the benchmark command (cqk_megatron.perf).

FLOPs are checked against ``torch.utils.flop_counter.FlopCounterMode`` on real models;
parameter counts against models built on the meta device (per pipeline stage, and per
tensor-parallel rank in two gloo processes); activation estimates against the bytes
autograd keeps on a CPU run in fp32, measured with a saved-tensor hook (PyTorch has
no allocator statistics on CPU). The benchmark runs end to end; no test reads a clock.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from _multiproc import run_ranks
from _tiny import tiny_config
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from cqk_megatron.bench import variants as bench
from cqk_megatron.bench.measure import SavedTensorMeter, saved_activation_bytes
from cqk_megatron.bench.overhead import count_variant_parameters
from cqk_megatron.cli import bench as bench_cli
from cqk_megatron.cli import plan as plan_cli
from cqk_megatron.config import CONFIGS_DIR, VARIANTS, load_config
from cqk_megatron.model.attention.fast_coupling import run_coupling
from cqk_megatron.model.gpt import build_model, count_parameters
from cqk_megatron.model.params import stage_parameters, total_parameters
from cqk_megatron.model.specs import coupling_spec
from cqk_megatron.parallel.process_groups import init_single_process
from cqk_megatron.perf import fit as plan
from cqk_megatron.perf.flops import (
    coupling_flops,
    flops_breakdown,
    flops_per_token,
    mfu,
    peak_flops,
)
from cqk_megatron.perf.memory import activation_estimate, model_state_bytes
from cqk_megatron.planner.parameters import variant_config

SEQ, BATCH, VOCAB = 32, 2, 256
REPO = Path(__file__).resolve().parent.parent
aten = torch.ops.aten


@pytest.fixture(scope="module", autouse=True)
def single_process():
    init_single_process()


def tiny(variant: str, *overrides: str, kv_groups: int = 4):
    return tiny_config(variant, *overrides, vocab=VOCAB, kv_heads=kv_groups, seq=SEQ)


def batch(seq: int = SEQ):
    tokens = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(0))
    return tokens, torch.arange(seq).expand(BATCH, seq)


# --- FLOPs -------------------------------------------------------------------------------

# PyTorch's CPU flash kernel is not in FlopCounterMode's table: count it with torch's own
# SDPA formula. Its backward: 2 x forward (the four matmuls of the backward, as the math
# path that differential attention takes on CPU counts them), or torch's flash backward
# formula, which adds the recomputed scores (hardware FLOPs).
MODEL_FLOPS_SDPA = {
    aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, **kw: sdpa_flop_count(
        q, k, v
    ),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda grad, q, k, v, *a, **kw: 2 * sdpa_flop_count(q, k, v)
    ),
}
HARDWARE_FLOPS_SDPA = {
    **MODEL_FLOPS_SDPA,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda grad, q, k, v, *a, **kw: sdpa_backward_flop_count(grad, q, k, v)
    ),
}


def counted_flops_per_token(model, mapping, backward: bool) -> float:
    tokens, positions = batch()
    counter = FlopCounterMode(display=False, custom_mapping=mapping)
    with counter:
        loss = model(tokens, positions, None, labels=tokens).mean()
        if backward:
            loss.backward()
    return counter.get_total_flops() / tokens.numel()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_flops_match_flop_counter(variant):
    config = tiny(variant, "attention.steps=2")  # two integrator steps, GQA (8 q / 4 kv)
    model = build_model(config)
    for module in model.modules():  # the paired form's SDPA calls, the FLOPs model's form
        if hasattr(module, "maps"):  # (paired_maps, its CPU kernel, multiplies the value once)
            module.maps = False
    forward = counted_flops_per_token(model, MODEL_FLOPS_SDPA, backward=False)
    training = counted_flops_per_token(model, MODEL_FLOPS_SDPA, backward=True)
    assert flops_per_token(config, training=False) == pytest.approx(forward, rel=0.05)
    assert flops_per_token(config, training=True) == pytest.approx(training, rel=0.05)
    parts = flops_breakdown(config)
    if VARIANTS[variant][0] != "none":
        assert parts["coupling"] > 0 and parts["elementwise_not_counted"] > 0


@pytest.mark.parametrize("kv_groups", [8, 4], ids=["mha", "gqa"])
@pytest.mark.parametrize("coupling", ["euler", "hamiltonian", "mlp_only", "invertible"])
def test_coupling_flops_are_exactly_those_of_the_form_that_runs(coupling, kv_groups):
    """Each coupling's registered FLOPs term against FlopCounterMode on the coupling as the
    layers run it (its fused form, eager): leapfrog's n + 1 kicks, fc2 on the key heads."""
    config = tiny(
        "standard",
        f"attention.coupling={coupling}",
        "attention.steps=3",
        "attention.invertible_layers=2",
        kv_groups=kv_groups,
    )
    d = config.model.head_dim
    spec = coupling_spec(config.attention, d)
    module = spec.module(head_dim=d, **spec.params)
    q, k = torch.randn(SEQ, BATCH, 8, d), torch.randn(SEQ, BATCH, kv_groups, d)
    counter = FlopCounterMode(display=False)
    with counter:
        run_coupling(module, q, k, impl="eager")
    assert counter.get_total_flops() / (SEQ * BATCH) == coupling_flops(config)


def test_flops_with_mha_and_flash_recompute():
    config = tiny("coupled", kv_groups=8)
    model = build_model(config)
    training = counted_flops_per_token(model, HARDWARE_FLOPS_SDPA, backward=True)
    assert flops_per_token(config, flash_recompute=True) == pytest.approx(training, rel=0.05)
    # what the flash backward adds is exactly one more score matmul
    recomputed = training - flops_per_token(config)
    assert recomputed == pytest.approx(flops_breakdown(config)["attention_scores"], rel=1e-6)


def test_dense_flops_are_twice_the_matmul_parameters():
    """Without attention: 2 FLOPs per weight per token (the 6N rule for training)."""
    config = load_config(CONFIGS_DIR / "models/7b.yaml")
    parts = flops_breakdown(config)
    m = config.model
    norms = (2 * m.num_layers + 1) * m.hidden_size
    matmul_weights = total_parameters(config) - norms - m.padded_vocab_size * m.hidden_size
    dense = parts["total"] - parts["attention_scores"] - parts["attention_context"]
    assert dense == 2 * matmul_weights
    # PaLM's attention term: 12 L H Q T per token for training -> 4 L s h forward
    attention = parts["attention_scores"] + parts["attention_context"]
    assert attention == 4 * m.num_layers * m.seq_length * m.hidden_size


def test_mfu_and_peak_table():
    config = tiny("standard")
    per_token = flops_per_token(config)
    assert mfu(1000.0, config, 989e12) == pytest.approx(1000.0 * per_token / 989e12)
    assert mfu(8000.0, config, 989e12, num_gpus=8) == pytest.approx(mfu(1000.0, config, 989e12))
    assert mfu(1000.0, config, None) is None
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Some Future GPU") is None
    if not torch.cuda.is_available():
        assert peak_flops() is None


# --- parameters --------------------------------------------------------------------------

STAGE_VARIANTS = ["standard", "coupled", "mlp_only", "invertible", "coupled_differential"]


@pytest.mark.parametrize(("variant", "kv_groups"), list(itertools.product(STAGE_VARIANTS, [8, 4])))
def test_stage_parameters_equal_built_model(variant, kv_groups):
    """Every pipeline stage (first, middle, last, only) of a 4-layer model split in 2."""
    config = tiny(variant, "model.num_layers=2", kv_groups=kv_groups)  # 2 = 4 layers / pp 2
    full = tiny(variant, "model.num_layers=4", kv_groups=kv_groups)
    for first, last in itertools.product([True, False], repeat=2):
        with torch.device("meta"):
            built = count_parameters(build_model(config, pre_process=first, post_process=last))
        assert stage_parameters(full, tp=1, pp=2, first=first, last=last) == built
    assert total_parameters(full) == count_variant_parameters(full, variant)


def test_tied_embeddings_stage_parameters():
    config = tiny("coupled", "model.tie_embeddings=true")
    for first, last in [(True, True), (False, True)]:
        with torch.device("meta"):
            built = count_parameters(build_model(config, pre_process=first, post_process=last))
        assert stage_parameters(config, first=first, last=last) == built


@pytest.mark.parametrize("model", ["350m", "3b"])
def test_total_parameters_of_real_configs(model):
    config = load_config(CONFIGS_DIR / f"models/{model}.yaml")
    for variant in ("coupled", "invertible_differential"):
        expected = count_variant_parameters(config, variant)
        assert total_parameters(variant_config(config, variant)) == expected


# sharded weights, and replicated coupling / differential parameters
TP_VARIANTS = ["standard", "coupled_differential", "invertible"]


def _tp_worker(rank, world_size, port, out_dir):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    from cqk_megatron.parallel.process_groups import init_model_parallel, init_process_group

    init_process_group()
    counts = {}
    for variant in TP_VARIANTS:
        config = tiny(variant, "parallel.tensor_parallel=2")
        init_model_parallel(config)
        for first, last in [(True, False), (False, True)]:
            with torch.device("meta"):
                model = build_model(config, pre_process=first, post_process=last)
            counts[f"{variant},{first},{last}"] = count_parameters(model)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(counts))


def test_stage_parameters_per_tensor_parallel_rank(tmp_path):
    run_ranks(_tp_worker, 2, str(tmp_path))
    for rank in range(2):
        counts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for key, built in counts.items():
            variant, first, last = key.split(",")
            config = tiny(variant)
            expected = stage_parameters(config, tp=2, first=first == "True", last=last == "True")
            assert expected == built, key


def test_model_state_bytes_per_engine():
    n, dp = 1000, 8
    ddp = model_state_bytes(n, "bf16", "ddp", dp)
    assert ddp == {"parameters": 2000, "gradients": 4000, "optimizer": 12000}  # 18 B/param
    assert model_state_bytes(n, "bf16", "zero1", dp)["optimizer"] == 1500
    assert model_state_bytes(n, "bf16", "distopt", dp) == model_state_bytes(n, "bf16", "zero1", dp)
    zero2 = model_state_bytes(n, "bf16", "zero2", dp)
    assert zero2["gradients"] == 500 and zero2["parameters"] == 2000
    zero3 = model_state_bytes(n, "bf16", "zero3", dp)
    assert sum(zero3.values()) == pytest.approx(18 * n / dp)
    assert model_state_bytes(n, "fp32", "ddp", 1) == {
        "parameters": 4000,
        "gradients": 4000,
        "optimizer": 8000,
    }


# --- activations -------------------------------------------------------------------------


def test_saved_tensor_meter_counts_distinct_storages():
    x = torch.randn(100, 50, requires_grad=True)
    with SavedTensorMeter() as meter:
        y = x.sin()  # keeps x
        z = y.exp()  # keeps z
        w = z[:, :10].cos()  # keeps a view of z: no new storage
    assert meter.bytes == 2 * 100 * 50 * 4
    with SavedTensorMeter(exclude=torch.nn.Linear(50, 3)) as meter:
        layer = torch.nn.Linear(50, 3)
    del w, layer


@pytest.mark.parametrize(
    ("variant", "kv_groups"),
    [(v, 4) for v in VARIANTS] + [("standard", 8), ("coupled", 8), ("differential", 8)],
)
def test_activation_estimate_within_20_percent_of_measured(variant, kv_groups):
    seq = 64
    config = tiny(variant, f"model.seq_length={seq}", "model.hidden_size=128", kv_groups=kv_groups)
    model = build_model(config)  # fp32 on CPU
    tokens, positions = batch(seq)
    measured = saved_activation_bytes(model, lambda: model(tokens, positions, None, labels=tokens))
    # PyTorch's CPU flash kernel needs values as wide as queries: differential -> math path
    kernel = "math" if config.attention.scoring == "differential" else "fused"
    estimate = activation_estimate(config, BATCH, seq, sdpa_kernel=kernel)
    total = (
        config.model.num_layers * estimate.layer_bytes
        + estimate.embedding_bytes
        + estimate.output_bytes
    )
    assert total == pytest.approx(measured, rel=0.20)


def test_recomputation_lowers_the_activation_estimate():
    config = load_config(CONFIGS_DIR / "models/1b.yaml", ["train.precision=bf16"])
    none, selective, full = (
        activation_estimate(config, 1, recompute=r).layer_bytes
        for r in ("none", "selective", "full")
    )
    assert full < selective < none
    assert full == 2048 * 2048 * 2  # the layer input only: s b h in bf16
    tp2 = activation_estimate(config, 1, tp=2, sequence_parallel=True).layer_bytes
    assert tp2 == pytest.approx(none / 2, rel=0.01)


# --- planner -----------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["1b", "3b", "7b"])
def test_planner_lists_layouts_on_8_gpus_of_80gib(model, capsys):
    path = str(CONFIGS_DIR / f"models/{model}.yaml")
    code = plan_cli.main(
        ["--config", path, "--gpus", "8", "--gpu-mem", "80GiB", "--all", "--no-build-check"]
    )
    out = capsys.readouterr().out
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.split()[-1:] in (["yes"], ["no"])]
    assert rows, out
    layouts = {(int(r[0]), int(r[1]), int(r[2]), r[4]): r[-1] == "yes" for r in rows}
    for tp, pp, dp, _ in layouts:
        assert tp * pp * dp == 8
    assert layouts[(8, 1, 1, "distopt")]  # the most sharded layout always fits
    assert not any(pp > 1 and engine in ("zero2", "zero3") for (_, pp, _, engine) in layouts)


def test_check_fits_refuses_an_impossible_layout():
    config = load_config(CONFIGS_DIR / "models/7b.yaml", ["train.precision=bf16"])
    result = plan.check_fits(config, world_size=1, gpu_mem_bytes=80 * 2**30, sharding="zero1")
    assert not result.fits
    worst = result.worst
    assert worst.total > 7.2e9 * 16  # 2 B params + 4 B grads + 12 B Adam, unsharded
    message = result.message
    assert f"needs {worst.total / 2**30:.1f} GiB" in message
    assert "usable 76.0 GiB of 80.0 GiB" in message
    assert "no layout of these GPUs fits" in message
    with pytest.raises(plan.PlanError, match="does not fit"):
        result.require()


def test_check_fits_accepts_and_suggests():
    config = load_config(
        CONFIGS_DIR / "models/7b.yaml",
        ["train.precision=bf16", "train.micro_batch_size=1", "train.global_batch_size=64"],
    )
    ok = plan.check_fits(config, world_size=8, gpu_mem_bytes=80 * 2**30, sharding="distopt")
    assert not ok.fits  # TP=1 x PP=1 replicates 7B's weights and gradients on each GPU
    assert "layouts of these GPUs that fit: TP=" in ok.message
    sharded = load_config(
        CONFIGS_DIR / "models/7b.yaml",
        ["train.precision=bf16", "parallel.tensor_parallel=8", "parallel.sequence_parallel=true"],
    )
    result = plan.check_fits(sharded, world_size=8, gpu_mem_bytes=80 * 2**30, sharding=1)
    assert result.fits and result.require() is result
    assert result.layout.optimizer_sharding == "zero1" and result.layout.dp == 1


def test_check_fits_reads_the_engine_from_the_config():
    base = ["train.precision=bf16", "parallel.tensor_parallel=8"]
    path = CONFIGS_DIR / "models/7b.yaml"
    zero3 = load_config(path, [*base, "train.engine=deepspeed", "train.zero_stage=3"])
    assert plan.sharding_of(zero3) == "zero3"
    assert plan.check_fits(zero3, 64, 80 * 2**30).layout.optimizer_sharding == "zero3"
    megatron = load_config(path, [*base, "train.engine=megatron"])
    assert plan.sharding_of(megatron) == "distopt"
    offload = load_config(path, [*base, "train.offload_optimizer=true"])
    on_gpu = plan.check_fits(offload, 8, 80 * 2**30)
    assert on_gpu.worst.parts["optimizer"] == 0  # Adam states in CPU memory


def test_parse_bytes():
    assert plan.parse_bytes("80GiB") == 80 * 2**30
    assert plan.parse_bytes("80GB") == 80 * 10**9
    assert plan.parse_bytes("1.5 MiB") == int(1.5 * 2**20)
    with pytest.raises(ValueError, match="80GiB"):
        plan.parse_bytes("eighty")


# --- benchmark and GPU check -------------------------------------------------------------

BENCH_TINY = ["model.num_layers=2", "model.hidden_size=64", "model.vocab_size=256"]


def test_bench_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--variants", "standard,coupled", "--steps", "1", "--warmup", "0", "--seq", "32"]
    assert bench_cli.main([*args, "--json", str(out), *BENCH_TINY]) == 0
    printed = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(printed) if line.startswith("variant"))
    assert printed[header].split()[:4] == ["variant", "step", "ms", "tokens/s"]
    rows = {line.split()[0]: line.split() for line in printed[header + 1 : header + 3]}
    assert set(rows) == {"standard", "coupled"}
    assert rows["standard"][3] == "1.000"  # the baseline's ratio to itself
    result = json.loads(out.read_text())
    by_variant = {row["variant"]: row for row in result["rows"]}
    assert by_variant["coupled"]["ratio"] > 0 and by_variant["coupled"]["activation_mib"] > 0
    assert by_variant["coupled"]["parameters"] > by_variant["standard"]["parameters"]
    assert result["meta"]["baseline"] == "standard" and result["meta"]["rounds"] == 1


def test_bench_attention_only():
    config = bench.load_bench_config("tiny", [*BENCH_TINY, "model.seq_length=16"])
    result = bench.run_benchmark(
        config, ["standard", "differential"], rounds=1, warmup=0, micro_batch=1, attention_only=True
    )
    assert [row["variant"] for row in result["rows"]] == ["standard", "differential"]
    assert result["rows"][0]["ratio"] == 1.0 and result["meta"]["attention_only"]


def test_bench_rejects_unknown_variant(capsys):
    with pytest.raises(SystemExit):
        bench_cli.main(["--variants", "standard,nonsense"])
    assert "nonsense" in capsys.readouterr().err
