"""The experiment planner (``cqk_megatron/planner/``): sweeps take their variants from the
registry, and the planner sits below launch, analysis and the training engine.

Pure Python (no model is built, no process started); the sweep's own behaviour is
``test_analysis.py``'s ladder tests and ``test_launch.py``'s sweep test."""

from __future__ import annotations

import ast
from pathlib import Path

from test_layering import _is_engine_spec

from cqk_megatron.config import load_config
from cqk_megatron.planner.sweep import expand_sweep
from cqk_megatron.variants import registry

REPO = Path(__file__).resolve().parents[1]
SWEEP = """
name: coded
variants: [standard, {variant}]
sizes:
  tiny:
    model: models/60m.yaml
    overrides: {{model.num_layers: 2, model.hidden_size: 64, model.num_attention_heads: 4}}
    tokens: 65536
    lr: 3.0e-3
    global_batch_size: 8
    micro_batch_size: 2
    layout: {{tensor_parallel: 1, pipeline_parallel: 1, nodes: 1, gpus_per_node: 2}}
"""


def test_a_preset_registered_in_code_expands_without_a_variant_file(tmp_path, monkeypatch):
    # A preset only the registry knows (register_variant's table, restored afterwards):
    # configs/variants/ has no file for it, which the old expansion read.
    variant = "euler_differential_coded"
    assert not (REPO / "configs" / "variants" / f"{variant}.yaml").exists()
    monkeypatch.setitem(registry._VARIANTS, variant, ("euler", "differential"))
    sweep = tmp_path / "coded.yaml"
    sweep.write_text(SWEEP.format(variant=variant))
    runs = {run["name"]: run for run in expand_sweep(sweep)}
    assert sorted(runs) == ["coded-tiny-euler_differential_coded-s0", "coded-tiny-standard-s0"]
    run = runs[f"coded-tiny-{variant}-s0"]
    assert "attention.coupling=euler" in run["overrides"]
    config = load_config(run["config"], run["overrides"])
    assert (config.attention.coupling, config.attention.scoring) == ("euler", "differential")
    assert config.attention.variant == variant


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _source(module: str) -> Path | None:
    """The file of an in-repo module (``cqk_megatron.x.y`` or ``launch.x``), if any."""
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_the_planner_sits_below_launch_analysis_and_training():
    seen: set[str] = set()
    todo = [
        f"cqk_megatron.planner.{p.stem}" for p in (REPO / "cqk_megatron" / "planner").glob("*.py")
    ]
    while todo:
        module = todo.pop()
        path = _source(module)
        if module in seen or path is None:
            continue
        seen.add(module)
        parents = [module.rsplit(".", n)[0] for n in range(1, module.count(".") + 1)]
        todo.extend(parents)  # importing a.b.c runs a/__init__.py and a/b/__init__.py
        todo.extend(m for m in _imports(path) if m.startswith(("cqk_megatron", "launch")))
    # the engines' torch-free half sits in config's layer (tests/test_layering.py), and
    # importing it runs training/__init__.py, which imports nothing
    seen_above = {m for m in seen if not _is_engine_spec(m) and m != "cqk_megatron.training"}
    above = sorted(
        m
        for m in seen_above
        if m.startswith(
            (
                "launch",
                "cqk_megatron.analysis",
                "cqk_megatron.training",
                "cqk_megatron.parallel.process_groups",
                "cqk_megatron.model.gpt",
                "cqk_megatron.bench",
                "cqk_megatron.repro",
            )
        )
    )
    assert {
        "cqk_megatron.planner.sweep",
        "cqk_megatron.config",
        "cqk_megatron.model.params",
    } <= seen
    # the planner uses perf's estimates (pre-flight's checkpoint size); perf never imports
    # the planner (tests/test_layering.py: perf is the lower layer)
    assert "cqk_megatron.perf.memory" in seen
    assert above == []
