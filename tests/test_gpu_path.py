"""What a first GPU run needs, checked on CPU in real runs of the training loop (gloo):

- sequence parallelism with the local spec (``norm.TorchNorm``): TP=2 + SP gives the 1-rank
  loss curve and gradient norm under both engines; two planted faults show the comparison
  sees a missing TP sum of the norms' gradients (DeepSpeed) and a second one (Megatron's
  ``finalize_model_grads`` adding its own, if the norms were marked ``sequence_parallel``);
- ``train.recompute`` (selective, full with both methods) changes no number of a run;
- an audit of every collective this package calls in those runs: each is called from
  ``training/collectives.py`` (or the model's gradient hooks, ``attention/tp_grads.py``)
  with its tensors on ``device()``.

Two spawns: one rank (initial weights, both engines' references), two ranks (the rest).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _gpu_path_workers import audited_train_runs
from _multiproc import run_ranks
from _training import exits, records

STEPS = 8
COUPLED_DIFFERENTIAL = ["attention.coupling=hamiltonian", "attention.scoring=differential"]
SP = ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"]
MEGATRON = ["train.engine=megatron"]
SELECTIVE = ["train.recompute=selective"]
FULL_BLOCK = ["train.recompute=full", "train.recompute_method=block", "train.recompute_num_layers=1"]
FULL_UNIFORM = ["train.recompute=full", "train.recompute_method=uniform"]
LOSS_TOLERANCE, NORM_TOLERANCE = 1e-5, 1e-4  # relative, a layout against the 1-rank run
OWNERS = {"cqk_megatron/training/collectives.py", "cqk_megatron/attention/tp_grads.py"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpu-path")
    r = str(root)
    # Clipping at 0.5 is active (gradient norms are ~1), so the global norm must agree too.
    same = [
        *COUPLED_DIFFERENTIAL,
        "train.eval_interval=100",
        "train.save_interval=100",
        "train.clip_grad=0.5",
        "train.checkpoint_hashes=false",
        f"train.train_steps={STEPS}",
        f"train.init_from={r}/init",
    ]
    one_rank = [("ref-ds", same, "none"), ("ref-mg", [*same, *MEGATRON], "none")]
    run_ranks(audited_train_runs, 1, r, [("init", COUPLED_DIFFERENTIAL)], one_rank)
    two_ranks = [
        ("ds-sp", [*same, *SP], "none"),
        ("ds-sp-selective", [*same, *SP, *SELECTIVE], "none"),
        ("ds-sp-unsummed", [*same, *SP], "unsummed"),
        ("mg-sp", [*same, *SP, *MEGATRON], "none"),
        ("mg-sp-full", [*same, *SP, *MEGATRON, *FULL_BLOCK], "none"),
        ("mg-sp-marked", [*same, *SP, *MEGATRON], "marked"),
        # DP=2 with full recompute, evaluating and saving: the loop's other collectives
        (
            "mg-dp2-full",
            [*same, *MEGATRON, *FULL_UNIFORM, "train.eval_interval=4", "train.save_interval=4"],
            "none",
        ),
    ]
    run_ranks(audited_train_runs, 2, r, [], two_ranks)
    return root


def _curve(runs: Path, name: str) -> list[tuple[float, float]]:
    assert exits(runs, name) == ["0"], name
    return [(r["loss"], r["grad_norm"]) for r in records(runs, name, "train")]


def _worst(runs: Path, name: str, reference: str) -> tuple[float, float]:
    """Largest relative difference of the losses and of the gradient norms."""
    got, expected = _curve(runs, name), _curve(runs, reference)
    assert len(got) == len(expected) == STEPS
    loss = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(got, expected, strict=True))
    norm = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(got, expected, strict=True))
    return loss, norm


@pytest.mark.parametrize(("run", "reference"), [("ds-sp", "ref-ds"), ("mg-sp", "ref-mg")])
def test_sequence_parallel_gives_the_one_rank_run(runs, run, reference):
    loss, norm = _worst(runs, run, reference)
    assert loss <= LOSS_TOLERANCE and norm <= NORM_TOLERANCE, (loss, norm)
    curve = _curve(runs, reference)
    assert curve[-1][0] < curve[0][0] - 0.5  # and it trains
    assert all(math.isfinite(n) and n > 0 for _, n in curve)


def test_a_missing_tp_sum_of_the_norm_gradients_is_seen(runs):
    # measured: loss 1.8e-4, gradient norm 1.1e-3 off; both far past the tolerances
    loss, norm = _worst(runs, "ds-sp-unsummed", "ref-ds")
    assert loss > 5 * LOSS_TOLERANCE and norm > 5 * NORM_TOLERANCE, (loss, norm)


def test_a_second_sum_by_megatrons_finalize_is_seen(runs):
    # Adam barely notices a doubled gradient (it divides by its scale), the norm does:
    # measured 3.9e-3 off
    _, norm = _worst(runs, "mg-sp-marked", "ref-mg")
    assert norm > 5 * NORM_TOLERANCE, norm


@pytest.mark.parametrize(
    ("run", "reference", "loss_tolerance", "norm_tolerance"),
    [
        ("ds-sp-selective", "ds-sp", 1e-6, 1e-6),  # same layout: the same numbers
        ("mg-sp-full", "mg-sp", 1e-6, 1e-6),
        ("mg-dp2-full", "ref-mg", LOSS_TOLERANCE, NORM_TOLERANCE),  # and another layout
    ],
)
def test_recompute_changes_no_number_of_a_run(
    runs, run, reference, loss_tolerance, norm_tolerance
):
    loss, norm = _worst(runs, run, reference)
    assert loss <= loss_tolerance and norm <= norm_tolerance, (loss, norm)


def _audits(runs: Path) -> list[dict]:
    paths = sorted(runs.glob("audit-*-rank*.json"))
    assert len(paths) == 3, paths  # one rank, then two
    return [json.loads(p.read_text()) for p in paths]


def test_every_collective_of_the_package_is_the_owners_on_the_device(runs):
    for audit in _audits(runs):
        for record in audit["records"]:
            assert record["caller"] in OWNERS, record
            assert record["devices"] in ("-", audit["device"]), (record, audit["device"])


def test_the_audit_saw_the_loops_collectives(runs):
    seen = {}
    for audit in _audits(runs):
        for record in audit["records"]:
            key = (record["caller"].rsplit("/", 1)[-1], record["function"])
            seen[key] = seen.get(key, 0) + record["calls"]
    # the parameter count, the stop flag and the loss every step; barriers at saves; the
    # TP sums of the replicated parameters' gradients (f, dt, lambda, norms under SP)
    assert seen.get(("collectives.py", "all_reduce"), 0) >= 3 * STEPS, seen
    assert seen.get(("collectives.py", "barrier"), 0) >= 3, seen
    assert seen.get(("tp_grads.py", "all_reduce"), 0) > 0, seen
