"""One run (variant, size, seed, token budget) planned through every entry point gives
the same validated config and the same parameter count: the experiment planner
(``planner.runs.plan_config``) is the one place a variant becomes a config.

Entry points: a sweep (``planner.sweep.expand_sweep``, as ``launch/submit.py --sweep``
plans it and as ``cqk-analyze ladder`` lists it), launch's own validation of a resolved
run (``launch.resolve.resolve``, the path ``launch.api.submit_local`` and ``--config`` take),
repro's plan, ``cqk-bench``'s ``variant_of``, ``cqk-plan``'s config and ``cqk-params``'
table. With the planner's variant resolution rewired (``coupled`` made Euler instead of
Hamiltonian), every entry point must follow it: one that built its own config (from
``VARIANTS`` or ``pair`` directly) would still say Hamiltonian and fail here.

Pure Python but for one meta-device build of the model (``cqk-params``' check)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cqk_megatron.config import CONFIGS_DIR, RunConfig, load_config, to_dict
from cqk_megatron.config.changes import flatten
from cqk_megatron.planner import runs as planner_runs
from cqk_megatron.planner.parameters import config_parameters
from cqk_megatron.planner.runs import plan_config

SIZE = CONFIGS_DIR / "repro" / "cpu-tiny.yaml"  # 4 x 256, 16 x 128 tokens a step
VARIANT, SEED, STEPS = "coupled", 3, 8
TOKENS = STEPS * 16 * 128
SWEEP = f"""
name: same
variants: [{VARIANT}]
seeds: [{SEED}]
sizes:
  tiny:
    model: repro/cpu-tiny.yaml
    tokens: {TOKENS}
    lr: 2.0e-3
    global_batch_size: 16
    micro_batch_size: 16
    layout: {{tensor_parallel: 1, pipeline_parallel: 1, nodes: 1, gpus_per_node: 1}}
"""

# The fields an entry point sets itself, and why; every other field must be the planner's.
OWNED = {
    "sweep": {
        "name": "{sweep}-{size}-{variant}-s{seed}",
        "train.schedule.warmup_steps": "the sweep's warmup_fraction of the steps",
        "train.eval_interval": "the sweep's eval_fraction of the steps",
    },
    "repro": {
        "name": "PRESET-VARIANT-sSEED",
        "log.root": "--out/runs",
        "data.prefixes": "--data",
        "data.tokenizer": "--tokenizer",
        "data.cache_dir": "one index cache per comparison",
        "data.seed": "one data order for every seed",
        "train.schedule.warmup_steps": "the preset's warmup fraction",
        "train.eval_interval": "the preset's evaluations per run",
        "train.checkpoint.save_interval": "the preset's checkpoints per run",
    },
    "bench": {"parallel.world_size": "one process"},
    "params": {"parallel.world_size": "one process"},
}
OWNED["ladder"] = OWNED["sweep"]
OWNED["launch_sweep"] = {**OWNED["sweep"], "log.root": "made absolute (or the profile's runs_root)"}
OWNED["launch"] = OWNED["repro"]  # launch resolves (validates) repro's run; changes nothing
OWNED["plan"] = {}


def _differences(config: RunConfig, reference: RunConfig) -> set[str]:
    a, b = flatten(to_dict(config)), flatten(to_dict(reference))
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


def _entry_point_configs(tmp_path: Path, capsys) -> dict[str, RunConfig]:
    from cqk_megatron.bench import variants as bench
    from cqk_megatron.cli.analyze import main as analyze
    from cqk_megatron.cli.plan import load_plan_config
    from cqk_megatron.planner.sweep import expand_sweep
    from cqk_megatron.repro.configs import build_reproduction
    from cqk_megatron.repro.data import DataChoice
    from cqk_megatron.repro.presets import PRESETS
    from launch.resolve import resolve, resolve_sweep
    from launch.resources import ClusterProfile, Resources

    configs = {}
    sweep = tmp_path / "same.yaml"
    sweep.write_text(SWEEP)
    [run] = expand_sweep(sweep)
    configs["sweep"] = load_config(run["config"], run["overrides"])
    [launched] = resolve_sweep(sweep, [], ClusterProfile(), {"tasks_per_node": 1}, "local")
    configs["launch_sweep"] = launched.config
    capsys.readouterr()
    analyze(["ladder", str(sweep)])
    listed = capsys.readouterr().out.splitlines()[0].split("GPUs", 1)[1].split()
    configs["ladder"] = load_config(SIZE, [f"name={run['name']}", *listed])

    preset = dataclasses.replace(PRESETS["cpu-tiny"], config=SIZE)
    data = DataChoice(tmp_path / "corpus", tmp_path / "tok.model", 8192, "a stand-in")
    reproduction = build_reproduction(
        preset, [VARIANT], [SEED], TOKENS, data, tmp_path, 1, [], cuda=False
    )
    [planned] = reproduction.runs
    configs["repro"] = planned.config
    configs["launch"] = resolve(planned.config, Resources(tasks_per_node=1), "local").config
    assert configs["launch"] == planned.config

    base = load_config(SIZE, [f"seed={SEED}", f"train.train_steps={STEPS}"])
    configs["bench"] = bench.variant_of(base, VARIANT)
    configs["plan"] = load_plan_config(
        str(SIZE), VARIANT, [f"seed={SEED}", f"train.train_steps={STEPS}"]
    )
    configs["params"] = planner_runs.one_rank(planner_runs.with_variant(base, VARIANT))
    return configs


@pytest.mark.parametrize("rewired", [False, True], ids=["registry", "rewired-planner"])
def test_every_entry_point_plans_the_same_run(tmp_path, capsys, monkeypatch, rewired):
    from cqk_megatron.bench.overhead import overhead_table

    expected = ("hamiltonian", "standard")
    if rewired:  # the planner's one variant lookup says otherwise: everyone must follow
        real = planner_runs.pair
        expected = ("euler", "standard")
        monkeypatch.setattr(planner_runs, "pair", lambda v: expected if v == VARIANT else real(v))
    reference = plan_config(
        SIZE, VARIANT, seed=SEED, overrides=[f"train.train_steps={STEPS}"], world_size=1
    )
    assert (reference.attention.coupling, reference.attention.scoring) == expected
    configs = _entry_point_configs(tmp_path, capsys)
    assert set(configs) == set(OWNED)
    count = config_parameters(reference)
    for entry, config in configs.items():
        attention = (config.attention.coupling, config.attention.scoring)
        assert attention == expected, f"{entry} built its own variant config: {attention}"
        extra = _differences(config, reference) - set(OWNED[entry])
        assert not extra, f"{entry}: {sorted(extra)} differ from the planner's config"
        assert config_parameters(config) == count, entry
    [row] = overhead_table(load_config(SIZE, [f"seed={SEED}"]), [VARIANT])
    assert row["parameters"] == count


def test_cqk_params_table_is_the_built_models_count():
    from cqk_megatron.bench.overhead import (
        built_differences,
        count_variant_parameters,
        overhead_table,
    )

    config = load_config(SIZE)
    rows = overhead_table(config, ["standard", VARIANT, "coupled_differential"])
    assert built_differences(config, rows) == []
    assert rows[1]["parameters"] == count_variant_parameters(config, VARIANT)
    assert rows[1]["extra"] > 0
    # and a wrong count would be reported
    wrong = [{**rows[1], "parameters": rows[1]["parameters"] + 1}]
    assert "the built model has" in built_differences(config, wrong)[0]
