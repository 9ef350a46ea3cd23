"""``train.resilience.check_replicas_interval``: the real training loop on two gloo ranks
compares every copy a layout keeps (data-parallel replicas, parameters whole on every
tensor-parallel rank, tied embeddings across pipeline stages) and passes where they agree;
one parameter pushed off on one rank (a negative control per kind of copy) stops the run,
naming it, the step and the ranks.

One spawn of two ranks runs everything (starting processes is the slow part on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _multiproc import run_ranks
from _replica_workers import Perturbation, perturbed_train_attempts
from _training import attempts

STEPS = 3
# f, dt, lambda and the differential RMSNorm: whole on every tensor-parallel rank
COUPLED_DIFFERENTIAL = ["attention.coupling=hamiltonian", "attention.scoring=differential"]
SAME = [
    *COUPLED_DIFFERENTIAL,
    f"train.train_steps={STEPS}",
    "train.eval_interval=100",
    "train.checkpoint.save_interval=100",
    "train.checkpoint.hashes=false",
    "train.resilience.check_replicas_interval=1",
]
DP2 = ["train.zero_stage=1"]
TP2_SP = ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"]
TP2_ZERO3 = ["parallel.tensor_parallel=2", "train.zero_stage=3"]
# the Megatron engine keeps tied copies equal (finalize_model_grads sums their gradients)
PP2_TIED = ["parallel.pipeline_parallel=2", "model.tie_embeddings=true", "train.engine=megatron"]
DT = "decoder.layers.1.self_attention.coupling.dt.raw"  # global layer 1
NORM = "decoder.final_layernorm.weight"
RUNS = {
    # name: (overrides, perturbation or None)
    "dp2": (DP2, None),
    "tp2-sp": (TP2_SP, None),
    "tp2-zero3": (TP2_ZERO3, None),
    "dp2-zero3": (["train.zero_stage=3"], None),  # no replicas across DP: said, not compared
    "pp2-tied": (PP2_TIED, None),
    "tp2-dt-off": (TP2_SP, Perturbation(DT, rank=1, step=2)),
    "dp2-norm-off": (DP2, Perturbation(NORM, rank=1, step=1)),
    "tp2-zero3-dt-off": (TP2_ZERO3, Perturbation(DT, rank=0, step=2)),
    "pp2-tied-off": (PP2_TIED, Perturbation("output_layer.weight", rank=1, step=2)),
    # the bug tests/test_gpu_path.py plants: SP norms' partial gradients left unsummed
    "tp2-sp-unsummed": (TP2_SP, "unsummed"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("replicas")
    entries = [(name, [*SAME, *extra], off) for name, (extra, off) in RUNS.items()]
    run_ranks(perturbed_train_attempts, 2, str(root), entries)
    return root


@pytest.mark.parametrize("name", [n for n, (_, off) in RUNS.items() if off is None])
def test_replicas_agree_step_by_step(runs, name):
    (attempt,) = attempts(runs, name)
    assert attempt.get("exit") == 0, attempt


def test_zero3_says_it_compares_no_data_parallel_copies(runs):
    (attempt,) = attempts(runs, "dp2-zero3")
    assert (
        "only tensor-parallel replicas and tied embedding copies are compared"
        in (attempt["stderr"])
    )


def test_norms_without_their_tp_gradient_sum_stop_the_run_at_step_1(runs):
    (attempt,) = attempts(runs, "tp2-sp-unsummed")
    assert attempt.get("error") == "ReplicaMismatch", attempt
    assert (
        "at step 1: decoder.layers.0.input_layernorm.weight is not the same on ranks [0, 1]"
        in attempt["message"]
    )


@pytest.mark.parametrize(
    ("name", "names", "kind"),
    [
        ("tp2-dt-off", DT, "tensor-parallel replicas"),
        ("dp2-norm-off", NORM, "data-parallel replicas"),
        ("tp2-zero3-dt-off", DT, "tensor-parallel replicas"),
        ("pp2-tied-off", "embedding.word_embeddings.weight", "tied embedding copies"),
    ],
)
def test_a_parameter_off_on_one_rank_stops_the_run_naming_it(runs, name, names, kind):
    perturbation = RUNS[name][1]
    (attempt,) = attempts(runs, name)
    assert attempt.get("error") == "ReplicaMismatch", attempt
    message = attempt["message"]
    assert f"at step {perturbation.step}: {names} is not the same on ranks [0, 1]" in message
    assert kind in message
    assert "rank 0 holds sha256" in message and "rank 1 holds sha256" in message
    # it stopped at that step, before saving it
    assert not any("iter_" in path for path in attempt["files"]), attempt["files"]
