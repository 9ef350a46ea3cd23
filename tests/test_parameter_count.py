"""Analysis and the sweep planner count parameters without starting a process group, and
the count is the built Megatron model's for every variant and model family.

The counting runs in a fresh interpreter: in this one other tests may already have
started a group, which would hide one started by the count."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import _tiny
import pytest
import torch

from cqk_megatron.config import CONFIGS_DIR, VARIANTS, family_overrides, load_config
from cqk_megatron.model.gpt import build_model, count_parameters
from cqk_megatron.parallel.process_groups import init_single_process

TINY = {"vocab": 100, "heads": 4, "kv_heads": None, "seq": 32}
# (name, overrides): GQA with tied embeddings on the default (Llama-style) model, for every
# variant; the GPT-2 family (LayerNorm, biases, learned positions, GELU) for two of them
SHAPES = {"llama-gqa-tied": ["model.num_query_groups=2", "model.tie_embeddings=true"]}
SHAPES["gpt2"] = family_overrides("gpt2")
CASES = [(variant, "llama-gqa-tied") for variant in VARIANTS]
CASES += [("standard", "gpt2"), ("coupled_differential", "gpt2")]
LADDER_MODEL = CONFIGS_DIR / "models" / "60m.yaml"


def tiny_overrides(variant: str, shape: str) -> list[str]:
    return [*_tiny.tiny_overrides(variant, **TINY), *SHAPES[shape]]


COUNT_IN_A_FRESH_PROCESS = """
import json, sys
import torch.distributed as dist
from cqk_megatron.analysis.ingest import count_total_parameters
from cqk_megatron.planner.sweep import standard_parameters
from cqk_megatron.config import load_config

cases, ladder_model = json.loads(sys.argv[1]), sys.argv[2]
counts = {key: count_total_parameters(load_config(None, overrides)) for key, overrides in cases}
counts["ladder"] = standard_parameters(ladder_model, [])
megatron_groups = False
if "megatron.core.parallel_state" in sys.modules:
    from megatron.core import parallel_state
    megatron_groups = parallel_state.model_parallel_is_initialized()
print(json.dumps({"process_group": dist.is_initialized(), "megatron_groups": megatron_groups,
                  "counts": counts}))
"""


@pytest.fixture(scope="module")
def fresh_counts() -> dict:
    cases = [[f"{variant}/{shape}", tiny_overrides(variant, shape)] for variant, shape in CASES]
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(COUNT_IN_A_FRESH_PROCESS),
            json.dumps(cases),
            str(LADDER_MODEL),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_counting_starts_no_process_group(fresh_counts):
    assert fresh_counts["process_group"] is False
    assert fresh_counts["megatron_groups"] is False


def _built(overrides: list[str], path=None) -> int:
    """The Megatron model's own count (TP=PP=1), built on the meta device."""
    config = load_config(
        path, [*overrides, "parallel.tensor_parallel=1", "parallel.pipeline_parallel=1"]
    )
    init_single_process(config)
    with torch.device("meta"):
        return count_parameters(build_model(config))


@pytest.mark.parametrize(("variant", "shape"), CASES)
def test_the_count_is_the_built_megatron_models(fresh_counts, variant, shape):
    expected = _built(tiny_overrides(variant, shape))
    assert fresh_counts["counts"][f"{variant}/{shape}"] == expected


def test_the_ladders_budget_count_is_the_built_standard_models(fresh_counts):
    assert fresh_counts["counts"]["ladder"] == _built([], LADDER_MODEL)
