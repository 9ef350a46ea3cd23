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
        assert config.train.precision == "bf16" and config.train.train_steps == 50
        assert config.train.check_replicas_interval > 0, name
        configs[name] = config
    assert configs[accept.ZERO3].train.zero_stage == 3
    assert configs[f"{accept.ZERO3}-resumed"].train.exit_after_steps == 25  # the mid-run save
    assert configs[f"{accept.ZERO3}"].train.save_interval == 25
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
