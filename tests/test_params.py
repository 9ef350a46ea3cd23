"""The one parameter count (``cqk_megatron.model.params``): torch-free, the count every caller
records, and equal to ``sum(p.numel())`` of a real Megatron model for every variant."""

from __future__ import annotations

import subprocess
import sys

import _tiny
import pytest
import torch
from _multiproc import run_ranks
from _training import config_for, records, train_runs

from cqk_megatron.config import VARIANTS, family_overrides, load_config, validate
from cqk_megatron.model import params
from cqk_megatron.model.gpt import build_model
from cqk_megatron.parallel.process_groups import init_single_process

# Llama-style with GQA, untied and tied; the GPT-2 family (LayerNorm, biases, learned
# positions, GELU MLP): each with every variant that its heads allow.
SHAPES = {
    "llama-gqa": ["model.num_query_groups=2"],
    "llama-gqa-tied": ["model.num_query_groups=2", "model.tie_embeddings=true"],
    "gpt2": family_overrides("gpt2"),
}
CASES = [(variant, shape) for variant in VARIANTS for shape in SHAPES]


def built_counts(config) -> tuple[int, int]:
    """(total, non-embedding) as ``sum(p.numel())`` of the Megatron model built on the meta
    device (TP=PP=1)."""
    init_single_process(config)
    with torch.device("meta"):
        model = build_model(config)
    total = sum(p.numel() for p in model.parameters())
    vocabulary = sum(
        p.numel()
        for name, p in model.named_parameters()
        if "word_embeddings" in name or "output_layer" in name
    )
    return total, total - vocabulary


@pytest.mark.parametrize(("variant", "shape"), CASES)
def test_the_one_count_is_the_built_megatron_models(variant, shape):
    overrides = _tiny.tiny_overrides(variant, vocab=100, heads=4, kv_heads=None, seq=32)
    config = validate(load_config(None, [*overrides, *SHAPES[shape]]))
    counted = (params.total_parameters(config), params.non_embedding_parameters(config))
    assert counted == built_counts(config)


def test_the_count_imports_no_torch():
    """The planner (token budgets, sweeps) counts on login nodes: no torch on the way."""
    code = (
        "import sys\n"
        "from cqk_megatron.model import params\n"
        "from cqk_megatron.planner import sweep\n"
        "from cqk_megatron.config import load_config, validate\n"
        "n = params.total_parameters(validate(load_config(None, [])))\n"
        "print(n, 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    count, torch_imported = done.stdout.split()
    assert int(count) > 0 and torch_imported == "False"


def test_the_training_record_is_the_one_count(tmp_path):
    """A pipeline of two stages with tied embeddings holds the tied output layer twice (one
    copy per stage, kept equal by Megatron); the model's count has it once."""
    name = "pp2-tied"
    overrides = [
        "parallel.pipeline_parallel=2",
        "model.tie_embeddings=true",
        "train.train_steps=1",
        "train.eval_interval=100",
        "train.checkpoint.save_interval=100",
    ]
    run_ranks(train_runs, 2, str(tmp_path), [(name, overrides)])
    (summary,) = records(tmp_path, name, "summary")
    config = config_for(str(tmp_path), name, overrides)
    assert summary["params_total"] == params.total_parameters(config)
    assert summary["params_non_embedding"] == params.non_embedding_parameters(config)
