"""The GPU acceptance command, as far as it runs without a GPU: ``--dry-run`` (stages,
budgets, every training run's config validated), the refusal to run without one, and the
parts of it that work on CPU (the SDPA kernel detection, the stage timer)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cqk_megatron.config import load_config, validate

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "gpu" / "accept.py"


def _load_accept():
    spec = importlib.util.spec_from_file_location("gpu_accept", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


accept = _load_accept()


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=REPO
    )


def test_dry_run_prints_the_stages_and_their_budgets():
    result = _run("--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for stage in accept.STAGES:
        assert f"{stage.name:<8} {stage.budget_s:>4} s" in out
    total = sum(stage.budget_s for stage in accept.STAGES)
    assert total <= accept.TOTAL_BUDGET_S == 480
    assert f"{total} s of budgets (limit 480 s)" in out
    for name in ("standard-deepspeed", "differential-megatron", "coupled-deepspeed-resumed"):
        assert f"  {name}: " in out
    assert ", ".join(accept.KERNEL_VARIANTS) in out
    assert "configs/models/1b.yaml coupled" in out and "planner activations" in out
    assert "speed: configs/runs/1b_4x8.yaml on one GPU, 8 layers, train.engine=megatron" in out
    for name in accept.two_gpu_runs(Path("/w"), accept.Sizes()):
        assert f"  {name}: TP=" in out


def test_the_new_stages_are_listed_and_the_budgets_fit_eight_minutes():
    names = [stage.name for stage in accept.STAGES]
    assert names[-2:] == ["speed", "multigpu"]
    assert sum(stage.budget_s for stage in accept.STAGES) < 480


def test_without_a_gpu_it_refuses_to_run_and_says_how():
    result = _run()
    assert result.returncode == 2
    assert "--dry-run" in result.stdout and "--allow-cpu" in result.stdout


def test_an_unknown_stage_is_refused():
    result = _run("--only", "train,trian")
    assert result.returncode == 2 and "trian" in result.stderr


def test_the_training_runs_are_valid_and_each_resumed_one_is_its_twin(tmp_path):
    sizes = accept.Sizes()
    runs = accept.train_runs(tmp_path, sizes)
    # each variant and the GPT-2 family under both engines, ZeRO-3, and the two twins
    assert len(runs) == 2 * (len(accept.TRAIN_VARIANTS) + 1) + 1 + len(accept.TWINS)
    configs = {}
    for name, overrides in runs.items():
        config = validate(load_config(REPO / "configs/runs/demo.yaml", overrides))
        assert config.train.precision == "bf16" and config.train.train_steps == 40
        assert config.train.resilience.check_replicas_interval > 0, name
        configs[name] = config
    assert configs[accept.ZERO3].train.zero_stage == 3
    assert (
        configs[f"{accept.ZERO3}-resumed"].train.resilience.exit_after_steps == 20
    )  # the mid-run save
    assert configs[f"{accept.ZERO3}"].train.checkpoint.save_interval == 20
    for engine in accept.ENGINES:
        gpt2 = configs[f"{accept.GPT2}-{engine}"]
        assert gpt2.model.family == "gpt2" and gpt2.attention.variant == "coupled"
        assert gpt2.train.engine == engine
    for twin, original in accept.TWINS.items():
        again = accept.resumed_command(runs[twin])
        assert sorted(accept.settings(again)) == sorted(accept.settings(runs[original]))


def test_the_kernel_check_names_every_required_variant():
    assert set(accept.FUSED_REQUIRED) <= set(accept.KERNEL_VARIANTS)
    assert {"differential@paired", "differential@split"} <= set(accept.KERNEL_VARIANTS)


def test_the_kernel_check_reads_the_kernels_an_attention_layer_ran():
    # On CPU PyTorch runs its flash kernel for standard attention (q, k, v of one width).
    from cqk_megatron.bench.variants import init_world, load_bench_config

    config = load_bench_config("tiny", [*accept.cpu_sizes().kernel_model])
    here = init_world(config)
    found = accept.variant_kernels(config, "standard", 1, here)
    assert found["kernels"] == ["flash"] and found["differential_kernel"] is None
    paired = accept.variant_kernels(config, "differential@paired", 1, here)
    assert paired["differential_kernel"] == "paired" and paired["kernels"]


def test_a_stage_over_its_budget_is_stopped():
    started = time.monotonic()
    with pytest.raises(accept.StageTimeout), accept.alarm(1):
        time.sleep(10)
    assert time.monotonic() - started < 5


def test_the_step_time_ratios_at_350m_are_checked_on_a_gpu():
    assert accept.ratio_check("350m", "coupled", 1.09, on_gpu=True) == ("<= 1.1", True)
    assert accept.ratio_check("350m", "coupled", 1.4, on_gpu=True) == ("<= 1.1", False)
    assert accept.ratio_check("350m", "differential", 1.3, on_gpu=True) == ("<= 1.25", False)
    assert accept.ratio_check("350m", "differential", 1.3, on_gpu=False) == ("<= 1.25", None)
    assert accept.ratio_check("1b", "coupled", 1.4, on_gpu=True) == ("reported", None)


# -- the speed stage: the 1B run's own settings on one GPU ---------------------------------


def _settings(config) -> dict:
    """A config less what the cut changes: layers, world size, batch, steps, data, logging."""
    from cqk_megatron.config import to_dict

    data = to_dict(config)
    data["model"].pop("num_layers")
    data["parallel"].pop("world_size")
    for key in ("global_batch_size", "train_steps", "eval_interval"):
        data["train"].pop(key)
    data["train"]["schedule"].pop("warmup_steps")
    for key in ("save_interval", "hashes"):
        data["train"]["checkpoint"].pop(key)
    return {section: data[section] for section in ("model", "attention", "parallel", "train")}


def test_the_cut_config_is_the_1b_run_less_its_layers_and_world(tmp_path):
    cut = accept.speed_config(tmp_path, accept.Sizes())
    full = validate(load_config(REPO / accept.RUN_1B))
    assert cut.model.num_layers < full.model.num_layers and cut.parallel.world_size == 1
    assert _settings(cut) == _settings(full)
    assert cut.train.engine == "megatron" and cut.train.overlap_grad_reduce
    assert cut.train.precision == "bf16"
    assert cut.train.global_batch_size == 4 * cut.train.micro_batch_size


def test_the_cut_config_fits_an_h100_by_the_planner(tmp_path):
    cut = accept.speed_config(tmp_path, accept.Sizes())
    hardware = accept.one_gpu_hardware("NVIDIA H100 80GB HBM3")
    predicted, planned = accept.speed_expectations(cut, hardware)
    assert planned < hardware.hbm_gib / 2
    # the model's prediction leaves room for both MFU thresholds to be met
    assert predicted * accept.MFU_OF_PREDICTION >= accept.MFU_FLOOR


def test_gpu_md_gives_the_speed_stages_thresholds_on_an_h100(tmp_path):
    # docs/gpu.md states what the stage expects on an H100: the step-time model's MFU and
    # the planner's memory for the cut config, and the bounds they give
    cut = accept.speed_config(tmp_path, accept.Sizes())
    predicted, planned = accept.speed_expectations(
        cut, accept.one_gpu_hardware("NVIDIA H100 80GB HBM3")
    )
    low, high = planned * (1 - accept.MEMORY_TOLERANCE), planned * (1 + accept.MEMORY_TOLERANCE)
    said = (
        f"On an H100 the step-time model predicts {predicted:.1%} MFU for the cut config and "
        f"the planner {planned:.1f} GiB (`python tests/gpu/accept.py --dry-run` prints both), "
        f"so the stage fails below {predicted * accept.MFU_OF_PREDICTION:.1%} MFU, or with a "
        f"peak outside {low:.1f}-{high:.1f} GiB."
    )
    assert said in " ".join((REPO / "docs" / "gpu.md").read_text().split())


def test_the_hardware_profile_follows_the_gpu_torch_reports():
    h100 = accept.one_gpu_hardware("NVIDIA H100 80GB HBM3")
    h200 = accept.one_gpu_hardware("NVIDIA H200")
    assert (h100.gpu, h100.hbm_gib, h100.gpus_per_node) == ("H100 SXM", 79, 1)
    assert (h200.gpu, h200.hbm_gib, h200.gpus_per_node) == ("H200 SXM", 139, 1)
    assert accept.one_gpu_hardware("NVIDIA A100-SXM4-80GB") is None


def test_the_speed_thresholds_judge_a_measurement():
    passed = accept.judge_speed(0.40, 0.478, 20.9, 20.1)
    assert [v.ok for v in passed] == [True, True, True]
    assert "MFU 40.0% is 84% of the predicted 47.8%" in passed[0].message
    slow = accept.judge_speed(0.36, 0.478, 20.1, 20.1)  # 75% of the prediction
    assert [v.ok for v in slow] == [False, True, True]
    assert "75% of the predicted 47.8% (at least 80%)" in slow[0].message
    low = accept.judge_speed(0.30, 0.36, 20.1, 20.1)  # 83% of a low prediction, under 35%
    assert [v.ok for v in low] == [True, False, True]
    assert "MFU 30.0% (at least 35%)" in low[1].message
    big = accept.judge_speed(0.40, 0.478, 22.4, 20.1)  # 11.4% over the planner
    assert [v.ok for v in big] == [True, True, False]
    assert "peak 22.40 GiB, planner 20.10 GiB: 11.4% apart (at most 10%)" in big[2].message
    assert accept.judge_speed(0.40, 0.478, 18.2, 20.1)[2].ok is True  # 9.5% under


# -- the two-GPU stage --------------------------------------------------------------------


def test_the_two_gpu_runs_are_the_layouts_from_one_start(tmp_path):
    runs = accept.two_gpu_runs(tmp_path, accept.Sizes())
    configs = {
        n: validate(load_config(REPO / "configs/runs/demo.yaml", o)) for n, o in runs.items()
    }
    reference = configs.pop(accept.TWO_GPU_REFERENCE)
    assert reference.parallel.tensor_parallel == reference.parallel.pipeline_parallel == 1
    tp, pp = configs["tp2sp"].parallel, configs["pp2vp2"].parallel
    assert (tp.tensor_parallel, tp.sequence_parallel) == (2, True)
    assert (pp.pipeline_parallel, pp.virtual_pipeline) == (2, 2)
    for config in (reference, *configs.values()):
        assert config.train.engine == "megatron" and config.train.precision == "bf16"
        assert config.train.init_from == f"{tmp_path}/init"
        assert config.train.train_steps == accept.Sizes().two_gpu_steps
    for overrides in accept.two_gpu_runs(tmp_path, accept.cpu_sizes()).values():  # --allow-cpu
        validate(load_config(REPO / "configs/runs/demo.yaml", overrides))


def test_the_two_gpu_tolerances_are_the_cpu_layout_tests():
    from _curves import BF16_FIRST_STEP, STEPS, TOLERANCE

    assert accept.TWO_GPU_LOSS_TOLERANCE == TOLERANCE["bf16"]["loss"]
    assert accept.TWO_GPU_FIRST_STEP_TOLERANCE == BF16_FIRST_STEP["loss"]
    assert accept.Sizes().two_gpu_steps == STEPS


def test_the_two_gpu_losses_are_judged_against_one_gpu():
    reference = [10.0, 9.0, 8.0]
    assert accept.judge_curves([10.0005, 9.01, 8.01], reference).ok  # 1.25e-3 worst
    drifted = accept.judge_curves([10.0, 9.0, 8.03], reference)
    assert not drifted.ok and "largest rel. gap 3.75e-03 (at most 0.002)" in drifted.message
    first = accept.judge_curves([10.002, 9.0, 8.0], reference)
    assert not first.ok and "step 1 2.00e-04 (at most 0.0001)" in first.message
    assert not accept.judge_curves([10.0, float("nan"), 8.0], reference).ok
    assert not accept.judge_curves([10.0, 9.0], reference).ok


def test_with_fewer_than_two_gpus_the_stage_is_skipped_and_says_why(tmp_path):
    assert accept.two_gpu_skip_reason(2) is None
    assert accept.two_gpu_skip_reason(1) == "skipped: 1 GPU(s) here, the stage needs 2"
    args = accept.argparse.Namespace(work=str(tmp_path), cpu_budget_scale=1.0)
    acceptance = accept.Acceptance(args)  # on this CPU machine: no GPU
    acceptance.multigpu(budget=10)
    (check,) = acceptance.report.checks
    assert (check.stage, check.ok) == ("multigpu", None)
    assert check.value == "skipped: 0 GPU(s) here, the stage needs 2"
    assert not (tmp_path / "runs").exists()  # nothing started
