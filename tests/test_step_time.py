"""The step-time model (cqk_megatron.planner.step_time), the GPU figures of the cluster
profiles (planner.hardware) and ``cqk plan --profile`` / ``--sweep``. Pure arithmetic on
configs: no test runs a model or reads a clock."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from cqk_megatron.cli import plan as plan_cli
from cqk_megatron.cli.plan_speed import rank_layouts, sweep_config
from cqk_megatron.config import CONFIGS_DIR, ConfigError, load_config
from cqk_megatron.perf import fit as plan
from cqk_megatron.perf.flops import flops_per_token
from cqk_megatron.perf.traffic import dp_collectives
from cqk_megatron.planner.hardware import load_hardware
from cqk_megatron.planner.step_time import predict_step
from cqk_megatron.planner.sweep import expand_sweep
from launch.resources import load_profile

H100 = CONFIGS_DIR / "clusters/example_h100.yaml"
H200 = CONFIGS_DIR / "clusters/example_h200.yaml"
RUN_1B = CONFIGS_DIR / "runs/1b_4x8.yaml"
LADDER = CONFIGS_DIR / "sweeps/ladder.yaml"
# the 1B run's former layout: TP=2 + SP x DP=16, DeepSpeed ZeRO-2 with overlap_comm
TP2_ZERO2 = [
    "parallel.tensor_parallel=2",
    "parallel.sequence_parallel=true",
    "train.engine=deepspeed",
    "train.zero_stage=2",
]


def run_1b(*overrides: str):
    return load_config(RUN_1B, list(overrides))


def test_the_example_profiles_carry_the_public_figures_and_still_launch():
    h100, h200 = load_hardware(H100), load_hardware(H200)
    assert (h100.peak_bf16_tflops, h100.hbm_tb_s, h100.gpus_per_node) == (989, 3.35, 8)
    assert (h200.peak_bf16_tflops, h200.hbm_tb_s, h200.hbm_gib) == (989, 4.8, 139)
    assert h100.intra_node_gb_s == 450 and h100.inter_node_gb_s == 50  # 900 both ways; NDR
    for path in (H100, H200):  # the launcher leaves the hardware block to the planner
        assert load_profile(path).resources.gpus_per_node == 8


def test_a_profile_without_gpu_figures_is_refused_naming_the_block(tmp_path: Path):
    with pytest.raises(ConfigError, match="no 'hardware:' block"):
        load_hardware(CONFIGS_DIR / "clusters/local.yaml")
    bad = tmp_path / "p.yaml"
    bad.write_text(H100.read_text().replace("inter_node_gb_s: 50", "inter_node_gb_s: 0"))
    with pytest.raises(ConfigError, match="'hardware.inter_node_gb_s' must be positive"):
        load_hardware(bad)


def test_the_parts_add_up_to_the_step_and_give_tokens_and_mfu():
    config = run_1b()
    p = predict_step(config, load_hardware(H100))
    assert p.step_s == pytest.approx(sum(p.parts.values()))
    tokens = config.train.global_batch_size * config.model.seq_length
    assert p.tokens_per_s_per_gpu == pytest.approx(tokens / p.step_s / 32)
    assert p.mfu == pytest.approx(p.tokens_per_s_per_gpu * flops_per_token(config) / 989e12)
    assert 0.2 < p.mfu < 0.5  # Megatron-LM publishes 41-48% on H100 (docs/performance.md)


def test_the_dp_traffic_priced_is_the_engines():
    # the communication audit compares what an engine issues with dp_collectives; the
    # model must price exactly those collectives
    for config in (run_1b(), run_1b(*TP2_ZERO2)):
        _check_dp_traffic(config)


def _check_dp_traffic(config):
    p = predict_step(config, load_hardware(H100))
    priced = [t for t in p.transfers if t.part.startswith("dp_")]
    expected = dp_collectives(config)
    assert [(t.kind, t.elements, t.dtype, t.calls) for t in priced] == [
        (c.kind, c.elements, c.dtype, c.calls) for c in expected
    ]
    dp = 32 // config.parallel.tensor_parallel
    assert priced and all(t.group_size == dp and t.link == "network" for t in priced)


def test_tensor_parallel_traffic_and_its_link():
    tp2 = predict_step(run_1b(*TP2_ZERO2), load_hardware(H100))
    sp = [t for t in tp2.transfers if t.part == "tp_sp"]
    # 16 layers x (2 forward + 2 backward) x 8 micro-batches, each kind
    assert {t.kind for t in sp} == {"all_gather", "reduce_scatter"}
    assert all(t.calls == 16 * 4 * 8 and t.link == "NVLink" for t in sp)
    assert all(t.elements == t.calls * 4 * 2048 * 2048 for t in sp)  # micro-batch x seq x h
    tp1 = predict_step(run_1b(), load_hardware(H100))
    assert not [t for t in tp1.transfers if t.part.startswith("tp_")]
    assert tp1.parts["tp_pp_in_line"] == 0


def test_the_pipeline_bubble_is_p_minus_1_over_v_slots():
    overrides = [
        "parallel.pipeline_parallel=4",
        "train.engine=megatron",
        "model.tie_embeddings=true",
    ]
    config = run_1b(*overrides)
    p = predict_step(config, load_hardware(H100))
    slot = (p.parts["compute"] + p.parts["tp_pp_in_line"]) / p.microbatches
    assert p.parts["pipeline_bubble"] == pytest.approx(3 * slot)
    interleaved = predict_step(
        dataclasses.replace(
            config, parallel=dataclasses.replace(config.parallel, virtual_pipeline=2)
        ),
        load_hardware(H100),
    )
    assert interleaved.parts["pipeline_bubble"] < p.parts["pipeline_bubble"]
    parts = {t.part for t in p.transfers}
    assert {"pp_p2p", "tied_embeddings"} <= parts


def test_what_the_engine_issues_inside_the_backward_is_hidden_and_the_rest_exposed():
    hardware = load_hardware(H100)
    overlapped = predict_step(run_1b("train.engine=megatron"), hardware)
    in_line = predict_step(
        run_1b("train.engine=megatron", "train.overlap_grad_reduce=false"), hardware
    )
    grads = [t for t in overlapped.transfers if t.part == "dp_gradients"]
    assert {t.overlapped for t in grads} == {True}
    # all but the last bucket hide behind the last micro-batch's backward
    assert all(t.seconds / t.calls <= t.exposed_s < 0.5 * t.seconds for t in grads)
    assert [t.exposed_s for t in in_line.transfers if t.part == "dp_gradients"] == [
        t.seconds for t in in_line.transfers if t.part == "dp_gradients"
    ]
    assert overlapped.parts["dp_exposed"] < in_line.parts["dp_exposed"]


def test_plan_ranks_the_fitting_layouts_by_predicted_speed(capsys):
    code = plan_cli.main(["--config", str(RUN_1B), "--profile", str(H100), "--no-build-check"])
    out = capsys.readouterr().out
    assert code == 0
    ranking = out.split("fastest first")[1].splitlines()[2:]
    rows = [line.split() for line in ranking if line[:4].strip().isdigit()]
    speeds = [float(r[-2].replace(",", "")) for r in rows]
    assert len(rows) >= 6 and speeds == sorted(speeds, reverse=True)
    assert "32 GPUs x 79.0 GiB" in out  # --gpus and --gpu-mem from the config and profile


def test_plan_explains_every_collective_of_one_layout(capsys):
    argv = ["--config", str(RUN_1B), "--profile", str(H100), "--no-build-check", "--explain"]
    assert plan_cli.main([*argv, "--tp", "2", "--zero", "2"]) == 0
    out = capsys.readouterr().out.split("fastest first")[1]
    assert "TP=2 PP=1 DP=16 SP zero2" in out
    for part in ("tp_sp", "tp_embedding", "tp_grad_sums", "dp_gradients", "dp_parameters"):
        assert part in out


def test_plan_prints_a_sweeps_gpu_hours(capsys):
    assert plan_cli.main(["--sweep", str(LADDER), "--profile", str(H100)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert len(rows) == 96  # 60M and 150M: 3 budgets x 3 and 1 seeds; the rest 1 x 1
    name, gpus, steps, step_s, _, hours = rows["ladder-1b-coupled-s0"]
    assert float(hours) == pytest.approx(float(step_s) * int(steps) * int(gpus) / 3600, rel=0.01)
    total = float(lines[-1].split()[1].replace(",", ""))
    listed = sum(float(r[-1].replace(",", "")) for r in rows.values())
    assert total == pytest.approx(listed, abs=0.05 * len(rows) + 0.5)


def test_plan_without_a_profile_refuses_explain(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main(["--config", str(RUN_1B), "--explain"])
    assert exit_info.value.code == 2
    assert "--explain and --sweep need --profile" in capsys.readouterr().err


# the cluster run configs: a layout each, its predicted speed in its comment
CLUSTER_RUNS = ["runs/350m_1x8.yaml", "runs/1b_4x8.yaml", "runs/7b_16x8.yaml"]


@pytest.mark.parametrize("name", CLUSTER_RUNS)
def test_each_cluster_run_config_is_the_models_choice_and_its_comment_says_so(name):
    # the layout ranked first, or within 5% of it with the first's MFU in the comment;
    # the predicted speed, MFU and memory as cqk plan prints them
    path, hardware = CONFIGS_DIR / name, load_hardware(H100)
    config = load_config(path, [])
    t, gpus = config.train, config.parallel.world_size
    results = plan.plan_all(
        config, gpus, hardware.hbm_bytes, t.micro_batch_size, global_batch=t.global_batch_size
    )
    ranked = rank_layouts(config, results, hardware, t.micro_batch_size, t.global_batch_size)
    first = ranked[0][1]
    shipped = predict_step(config, hardware)
    assert shipped.tokens_per_s_per_gpu >= 0.95 * first.tokens_per_s_per_gpu
    memory = next(r for r, p in ranked if p.tokens_per_s_per_gpu == shipped.tokens_per_s_per_gpu)
    comment = _one_line(
        " ".join(line.lstrip("# ") for line in path.read_text().splitlines() if line[:1] == "#")
    )
    assert (
        f"predicts {shipped.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {shipped.mfu:.1%} MFU, "
        f"{memory.worst.total / plan.GIB:.1f} GiB a GPU"
    ) in comment
    if first.tokens_per_s_per_gpu > shipped.tokens_per_s_per_gpu:
        share = shipped.tokens_per_s_per_gpu / first.tokens_per_s_per_gpu
        assert f"{share:.0%} of the first's speed" in comment and f"{first.mfu:.1%})" in comment


PERFORMANCE_DOC = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth"]
# docs/performance.md's rows of the 1B run's layouts, by the layout `cqk plan` prints
DOCUMENTED_1B_LAYOUTS = {
    "TP=1 PP=1 DP=32 distopt recompute=none": "| TP=1 x DP=32, distributed optimizer",
    "TP=2 PP=1 DP=16 SP distopt recompute=none": "| TP=2 + SP x DP=16, distributed optimizer |",
    "TP=2 PP=1 DP=16 SP zero2 recompute=none": "| TP=2 + SP x DP=16, DeepSpeed ZeRO-2",
}


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _ranked_1b() -> dict[str, tuple[int, object, object]]:
    """The 1B run's fitting layouts on H100 nodes: {layout: (place, PlanResult, prediction)}."""
    config, hardware = run_1b(), load_hardware(H100)
    t = config.train
    results = plan.plan_all(
        config, 32, hardware.hbm_bytes, t.micro_batch_size, global_batch=t.global_batch_size
    )
    ranked = rank_layouts(config, results, hardware, t.micro_batch_size, t.global_batch_size)
    return {r.layout.describe(): (i, r, p) for i, (r, p) in enumerate(ranked)}


def test_the_1b_layouts_in_the_docs_and_the_configs_comment_are_what_plan_prints():
    ranked = _ranked_1b()
    lines = PERFORMANCE_DOC.read_text().splitlines()
    for layout, row_start in DOCUMENTED_1B_LAYOUTS.items():
        _, result, p = ranked[layout]
        row = next(line for line in lines if line.startswith(row_start))
        cells = [cell.strip() for cell in row.split("|")[2:-1]]
        comm = p.parts["tp_pp_in_line"] + p.parts["dp_exposed"] + p.parts["step_end_sums"]
        assert cells[0] == f"{result.worst.total / plan.GIB:.1f} GiB", layout
        assert cells[1:3] == [f"{p.step_s * 1e3:.1f} ms", f"{p.parts['compute'] * 1e3:.1f} ms"]
        assert cells[3].startswith(f"{comm * 1e3:.1f} ms"), layout
        assert cells[4:] == [f"{p.tokens_per_s_per_gpu:,.0f}", f"{p.mfu:.1%}"], layout
    doc = _one_line(PERFORMANCE_DOC.read_text())
    zero2_p = ranked["TP=2 PP=1 DP=16 SP zero2 recompute=none"][2]
    gradients = [t for t in zero2_p.transfers if t.part == "dp_gradients"]
    sent = {  # GB each rank sends a step over data parallelism
        layout: sum(t.bytes_per_step for t in ranked[layout][2].transfers if t.part[:3] == "dp_")
        for layout in DOCUMENTED_1B_LAYOUTS
    }
    assert (
        f"{sum(t.bytes_per_step for t in gradients) / 1e9:.1f} GB sent per rank a step across "
        f"nodes, {sum(t.exposed_s for t in gradients) * 1e3:.0f} ms of it exposed, against "
        f"{sent['TP=2 PP=1 DP=16 SP distopt recompute=none'] / 1e9:.1f} GB for the distributed "
        f"optimizer at TP=2 ({sent['TP=1 PP=1 DP=32 distopt recompute=none'] / 1e9:.1f} GB at "
        "TP=1, the shipped layout)"
    ) in doc
    comment = _one_line(
        " ".join(line.lstrip("# ") for line in RUN_1B.read_text().splitlines() if line[:1] == "#")
    )
    _, shipped, _ = ranked["TP=1 PP=1 DP=32 distopt recompute=none"]
    assert f"{shipped.worst.total / plan.GIB:.1f} GiB a GPU" in comment
    tp2, _, tp2_p = ranked["TP=2 PP=1 DP=16 SP distopt recompute=none"]
    assert f"TP=2 + SP comes {ORDINALS[tp2]} ({tp2_p.mfu:.1%}" in comment
    zero2, _, zero2_p = ranked["TP=2 PP=1 DP=16 SP zero2 recompute=none"]
    assert f"ZeRO-2 at TP=2 {ORDINALS[zero2]} ({zero2_p.mfu:.1%}" in comment


def test_the_ladders_mfu_and_gpu_hours_in_the_docs_are_what_plan_prints():
    doc = _one_line(PERFORMANCE_DOC.read_text())
    runs = expand_sweep(LADDER)
    mfu = {
        size.upper(): predict_step(sweep_config(next(r for r in runs if r["name"] == name)), hw)
        for size, name in LADDER_RUNS.items()
        for hw in [load_hardware(H100)]
    }
    listed = ", ".join(f"{size} {p.mfu:.1%}" for size, p in mfu.items())
    assert f"{listed} MFU" in doc
    for profile, said in ((H100, "**{:,.0f} GPU-hours on H100**"), (H200, "({:,.0f} on H200")):
        hardware = load_hardware(profile)
        hours = {
            r["name"]: predict_step(sweep_config(r), hardware).gpu_hours(
                r["schedule"]["train_steps"]
            )
            for r in runs
        }
        assert said.format(sum(hours.values())) in doc
        if profile == H100:
            seven_b = sum(h for name, h in hours.items() if name.startswith("ladder-7b-"))
            assert f"of which 7B takes {seven_b:,.0f}" in doc


# the ladder's sizes; 60M and 150M carry several token budgets, named by the 20 one
LADDER_RUNS = {
    "60m": "ladder-60m-standard-t20-s0",
    "150m": "ladder-150m-standard-t20-s0",
    "350m": "ladder-350m-standard-s0",
    "1b": "ladder-1b-standard-s0",
    "3b": "ladder-3b-standard-s0",
    "7b": "ladder-7b-standard-s0",
}
WITHIN_5_PERCENT = ("350m", "1b", "3b", "7b")  # the sizes the ladder's comment says so of


@pytest.mark.parametrize("size", sorted(LADDER_RUNS))
def test_the_ladders_layouts_are_the_models_choice_as_their_comments_say(size):
    # configs/sweeps/ladder.yaml: each size's layout (standard variant), its predicted MFU
    # in the comment above it, and the first's where it is not the first; from 350M up
    # within 5% of the layout the model ranks first on its GPUs
    runs = {r["name"]: r for r in expand_sweep(LADDER)}
    config, hardware = sweep_config(runs[LADDER_RUNS[size]]), load_hardware(H100)
    t = config.train
    results = plan.plan_all(
        config,
        config.parallel.world_size,
        hardware.hbm_bytes,
        t.micro_batch_size,
        global_batch=t.global_batch_size,
    )
    ranked = rank_layouts(config, results, hardware, t.micro_batch_size, t.global_batch_size)
    shipped, first = predict_step(config, hardware), ranked[0][1]
    if size in WITHIN_5_PERCENT:
        assert shipped.tokens_per_s_per_gpu >= 0.95 * first.tokens_per_s_per_gpu
    block = re.search(rf"\n  {size}:\n(.*?)(\n  \w+:\n|\Z)", LADDER.read_text(), re.S)[1]
    assert f"{shipped.mfu:.1%} MFU predicted" in block
    if first.tokens_per_s_per_gpu > shipped.tokens_per_s_per_gpu:
        assert f": {first.mfu:.1%}" in block, f"{size}: the first's MFU, {first.mfu:.1%}"
