"""``cqk demo --seeds N``: the four variants of the demo's largest model over seeds, as one
sweep through the local launcher, and the table that pairs each seed with standard's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cqk_megatron.cli.demo_seeds import final_perplexities, format_table, write_sweep

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("standard", "coupled", "differential", "coupled_differential")


def fake_run(
    runs: Path, name: str, coupling: str, scoring: str, seed: int, ppl: float, **attention
) -> None:
    folder = runs / name
    folder.mkdir(parents=True)
    attention = {"coupling": coupling, "scoring": scoring, **attention}
    config = {"name": name, "seed": seed, "attention": attention}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    records = [
        {"kind": "eval", "step": 1, "val_ppl": 900.0},
        {"kind": "eval", "step": 2, "val_ppl": ppl, "final": True},
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_table_pairs_each_seed_with_standard(tmp_path):
    """The issue's table: differential's paired differences are per seed, not of means."""
    runs = tmp_path / "runs"
    standard = (119.65, 112.86, 116.68)
    differential = (143.33, 134.89, 155.00)
    for seed in range(3):
        fake_run(runs, f"s-standard-s{seed}", "none", "standard", seed, standard[seed])
        fake_run(runs, f"s-diff-s{seed}", "none", "differential", seed, differential[seed])
    (runs / "unfinished").mkdir()
    (runs / "unfinished" / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    table = final_perplexities(runs)
    assert table == {
        "standard": dict(enumerate(standard)),
        "differential": dict(enumerate(differential)),
    }
    text = format_table(table)
    lines = text.splitlines()
    assert lines[2].startswith("| standard | 119.65 / 112.86 / 116.68 | 116.40 | - |")
    assert "| differential | 143.33 / 134.89 / 155.00 | 144.41 |" in lines[3]
    assert "+19.8% / +19.5% / +32.8% (mean +24.1%, sd 7.6, s.e. 4.4)" in lines[3]


def test_seeds_sweep_is_the_demo_w128_model_with_the_seeds_asked_for(tmp_path):
    from cqk_megatron.planner.sweep import expand_sweep

    runs = expand_sweep(write_sweep(tmp_path, 2))
    assert sorted(run["name"] for run in runs) == sorted(
        f"seeds-w128-{variant}-s{seed}" for variant in VARIANTS for seed in (0, 1)
    )
    demo = {run["name"]: run for run in expand_sweep(REPO / "configs/sweeps/demo.yaml")}
    # the same run as the demo's largest size, but for the name
    ours = next(run for run in runs if run["name"] == "seeds-w128-standard-s0")
    theirs = demo["demo-w128-standard-s0"]
    assert ours["schedule"] == theirs["schedule"]
    assert [o for o in ours["overrides"] if not o.startswith("name=")] == [
        o for o in theirs["overrides"] if not o.startswith("name=")
    ]


def test_table_names_a_scoring_setting_and_pairs_it_with_standard(tmp_path):
    """Runs with attention.differential_norm set sit beside the unchanged ones, each their
    own row, paired with standard attention on the same seed."""
    runs = tmp_path / "runs"
    for seed, (std, paper, none) in enumerate([(119.65, 143.33, 114.97), (112.86, 134.89, 108.73)]):
        fake_run(runs, f"s-standard-s{seed}", "none", "standard", seed, std)
        fake_run(runs, f"s-diff-s{seed}", "none", "differential", seed, paper)
        fake_run(
            runs, f"n-diff-s{seed}", "none", "differential", seed, none, differential_norm="none"
        )
    lines = format_table(final_perplexities(runs)).splitlines()
    assert [line.split(" | ")[0][2:] for line in lines[2:]] == [
        "standard",
        "differential",
        "differential (differential_norm=none)",
    ]
    assert "| 114.97 / 108.73 | 111.85 | -3.9% / -3.7% (mean -3.8%" in lines[4]


def test_table_names_each_study_by_its_overrides_whatever_section_they_set(tmp_path):
    """Two studies in one --out: the unchanged one and one that sets a model field (no
    scoring option). Before, both landed in the row "differential" and the second run of a
    seed silently replaced the first."""
    study = tmp_path / "seeds"
    write_sweep(study, 2)
    write_sweep(study, 2, ["differential"], ["model.init_method_std=0.051"])
    write_sweep(study, 2, ["differential"], ["attention.differential_lambda_init=0.8"])
    runs = study / "runs"
    for seed in (0, 1):
        fake_run(runs, f"seeds-w128-standard-s{seed}", "none", "standard", seed, 100.0)
        fake_run(runs, f"seeds-w128-differential-s{seed}", "none", "differential", seed, 120.0)
        fake_run(
            runs,
            f"seeds_init_method_std_0_051-w128-differential-s{seed}",
            "none",
            "differential",
            seed,
            110.0,
        )
        fake_run(
            runs,
            f"seeds_differential_lambda_init_0_8-w128-differential-s{seed}",
            "none",
            "differential",
            seed,
            102.0,
            differential_lambda_init=0.8,
        )
    table = final_perplexities(runs)
    assert table == {
        "standard": {0: 100.0, 1: 100.0},
        "differential": {0: 120.0, 1: 120.0},
        "differential (init_method_std=0.051)": {0: 110.0, 1: 110.0},
        "differential (differential_lambda_init=0.8)": {0: 102.0, 1: 102.0},
    }


def test_two_runs_of_one_row_and_seed_are_refused(tmp_path):
    runs = tmp_path / "runs"
    fake_run(runs, "a-diff-s0", "none", "differential", 0, 120.0)
    fake_run(runs, "b-diff-s0", "none", "differential", 0, 110.0)
    with pytest.raises(ValueError, match="a second run of differential with seed 0"):
        final_perplexities(runs)


def test_seeds_sweep_takes_variants_and_overrides(tmp_path):
    """``--variants`` and ``attention.X=...``: the same runs but for the setting, named
    apart (so that a finished unchanged run is never taken for one of these)."""
    from cqk_megatron.planner.sweep import expand_sweep

    path = write_sweep(
        tmp_path, 2, ["differential", "coupled_differential"], ["attention.differential_norm=none"]
    )
    runs = {run["name"]: run for run in expand_sweep(path)}
    assert sorted(runs) == sorted(
        f"seeds_differential_norm_none-w128-{v}-s{s}"
        for v in ("differential", "coupled_differential")
        for s in (0, 1)
    )
    plain = {run["name"]: run for run in expand_sweep(write_sweep(tmp_path / "plain", 2))}
    ours = runs["seeds_differential_norm_none-w128-differential-s1"]["overrides"]
    theirs = plain["seeds-w128-differential-s1"]["overrides"]
    assert "attention.differential_norm=none" in ours
    assert sorted(
        o for o in ours if not o.startswith(("name=", "attention.differential_norm"))
    ) == (sorted(o for o in theirs if not o.startswith("name=")))


def test_demo_seeds_refuses_unknown_variants_and_stray_overrides(tmp_path):
    result = cqk_demo(
        "--seeds", "1", "--variants", "differentail", "--out", str(tmp_path), timeout=120
    )
    assert (
        result.returncode == 2 and "--variants 'differentail': choose presets of" in result.stderr
    )
    result = cqk_demo("attention.differential_norm=none", "--out", str(tmp_path), timeout=120)
    assert result.returncode == 2
    assert "--variants and config overrides go with --seeds N" in result.stderr
    result = cqk_demo("--seeds", "1", "differential_norm", "--out", str(tmp_path), timeout=120)
    assert result.returncode == 2 and "is not a config override" in result.stderr


def cqk_demo(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "WANDB_SILENT": "true"}
    return subprocess.run(
        [sys.executable, "-m", "cqk_megatron", "demo", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_demo_seeds_runs_the_four_variants_and_prints_the_table(tmp_path):
    """One seed, two steps a run: the corpus, the sweep through the launcher, the table."""
    out = tmp_path / "out"
    result = cqk_demo("--seeds", "1", "--steps", "2", "--out", str(out), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert yaml.safe_load((out / "seeds" / "sweep.yaml").read_text())["seeds"] == [0]
    table = final_perplexities(out / "seeds" / "runs")
    assert sorted(table) == sorted(VARIANTS) and all(list(t) == [0] for t in table.values())
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0][2:] for row in rows[1:]] == [
        "standard",
        "coupled",
        "coupled_differential",
        "differential",
    ]


def test_demo_seeds_refuses_fewer_than_one(tmp_path):
    result = cqk_demo("--seeds", "0", "--out", str(tmp_path), timeout=120)
    assert result.returncode == 2
    assert "--seeds 0: give 1 or more" in result.stderr


def test_diff_gap_sizes_change_one_setting_each_of_the_demo_model():
    """configs/sweeps/diff_gap.yaml: each size is the seeds study's run with the one
    setting its comment names changed (and the checkpoint interval, which trains alike)."""
    from cqk_megatron.planner.sweep import expand_sweep

    def settings(run):
        return {
            o.split("=", 1)[0]: o.split("=", 1)[1]
            for o in run["overrides"]
            if not o.startswith(("name=", "train.checkpoint.save_interval="))
        }

    base = settings(expand_sweep(REPO / "configs/sweeps/demo_seeds.yaml")[6])  # differential s0
    changed = {
        "init051": {"model.init_method_std": "0.051"},
        "h8": {"model.num_attention_heads": "8"},
        "lr1e3": {"train.optimizer.lr": "0.001", "train.schedule.min_lr": "0.0001"},
        "lr4e3": {"train.optimizer.lr": "0.004", "train.schedule.min_lr": "0.0004"},
        "nonorm": {"attention.differential_norm": "none"},
        "smallstart": {"attention.differential_norm": "small_start"},
        "lambda08": {"attention.differential_lambda_init": "0.8"},
    }
    runs = expand_sweep(REPO / "configs/sweeps/diff_gap.yaml")
    for size, change in changed.items():
        run = next(r for r in runs if r["name"] == f"diffgap-{size}-differential-s0")
        assert settings(run) == {**base, **change}, size
