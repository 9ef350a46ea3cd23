"""Every attention variant under TP=2, PP=2 and TP=2 x PP=2 equals the single process.

Each layout runs in real processes (gloo on 127.0.0.1) through Megatron's own schedules,
from the same weights and batches as a TP=1, PP=1 reference, in fp64 so that layout
bugs stand far above rounding (Megatron's cross entropy still rounds the loss in fp32).
Compared: the loss of each of 3 steps, every first-step gradient, and every parameter
after 3 SGD-with-momentum steps, each to 1e-5 relative (loss 1e-6).
"""

from __future__ import annotations

import json

import pytest
from _equivalence import worker
from _multiproc import run_ranks
from _tiny import tiny_shape

from cqk_megatron.config import VARIANTS

TINY = tiny_shape(vocab=256, layers=4, heads=None, kv_heads=None, seq=16, precision="fp64")
GQA = [*TINY, "model.num_attention_heads=8", "model.num_query_groups=4"]
MHA = [*TINY, "model.num_attention_heads=8"]
TOLERANCE = {"loss": 1e-6, "grad": 1e-5, "param": 1e-5}


def run_layout(tmp_path, tp, pp, variants, overrides, control=None, also_sp=False) -> dict:
    run_ranks(worker, tp * pp, tp, pp, variants, overrides, str(tmp_path), control, also_sp)
    return {
        rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(tp * pp)
    }


def failures(results: dict, variants) -> list[str]:
    found = []
    for rank, by_variant in results.items():
        for variant in variants:
            result = by_variant[variant]
            for kind, tolerance in TOLERANCE.items():
                if result[kind] > tolerance:
                    worst = result.get(f"{kind}_worst", "")
                    found.append(f"rank {rank} {variant}: {kind} {result[kind]:.2e} {worst}")
    return found


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_every_variant_matches_single_process(tmp_path, tp, pp):
    # Under TP=2 every variant also runs with sequence parallelism (norms, dropout and the
    # coupling on sequence shards; the TP=1 reference cannot have it), from the same
    # reference. Differential attention runs in its paired form here (auto on CPU).
    variants = list(VARIANTS)
    control = "coupled_differential" if tp > 1 else None
    results = run_layout(tmp_path, tp, pp, variants, GQA, control, also_sp=tp > 1)
    compared = [*variants, *(f"{v}[sp]" for v in variants)] if tp > 1 else variants
    assert failures(results, compared) == []
    last_stage = [r for r in results.values() if r[variants[0]]["has_loss"]]
    assert len(last_stage) == tp, "the last pipeline stage reports the losses"
    for variant in variants:
        assert len(last_stage[0][variant]["losses"]) == 3
    if control:
        # Negative control: without summing the replicated parameters' gradients across
        # TP ranks, the harness must see the difference.
        unsynced = results[0][f"{control}[no-tp-grad-sum]"]
        assert unsynced["grad"] > 1e-3, unsynced


def test_tp2_pp2_matches_single_process(tmp_path):
    variants = ["coupled", "coupled_differential"]
    results = run_layout(tmp_path, 2, 2, variants, MHA)
    assert failures(results, variants) == []
    assert sum(r["coupled"]["has_loss"] for r in results.values()) == 2


def test_split_differential_form_matches_single_process_under_tp2(tmp_path):
    """The four-call form of differential attention (attention.differential_kernel=split)
    under TP=2, GQA, with the negative control of the replicated lambda/RMSNorm gradient
    sum. (The paired form, auto on CPU, is in test_every_variant_matches_single_process.)"""
    variants = ["differential", "coupled_differential"]
    overrides = [*GQA, "attention.differential_kernel=split"]
    results = run_layout(tmp_path, 2, 1, variants, overrides, control="differential")
    assert failures(results, variants) == []
    assert results[0]["differential[no-tp-grad-sum]"]["grad"] > 1e-3
