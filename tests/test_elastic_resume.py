"""Elastic resume: a run requeued under another parallel layout keeps its optimizer state
(fp32 master weights, Adam moments, step count) wherever the engine's checkpoint format
reshards, and says before its first step when it cannot.

Each run below trains STEPS steps of the tiny model in fp32; the ``to1``/``to2`` runs stop
after step STOP (``train.resilience.exit_after_steps``) and resume under the other data-parallel
size, under each engine: Megatron's distributed optimizer in both checkpoint formats
(``train.optimizer_checkpoint``), DeepSpeed ZeRO-1 and ZeRO-3 (converted to DeepSpeed's
universal checkpoint at resume). Their losses after the resume must equal an
uninterrupted DP=2 run's to 1e-5 relative (the support matrix's tolerance between DP=2
and DP=1). The loss of step STOP + 1 comes before its update, so it would match with a
fresh optimizer too; from STOP + 2 on a fresh Adam's first update (about ``lr`` per
weight) shows: the TP=2 -> TP=1 DeepSpeed run, whose optimizer restarts by design, is the
control that this tolerance catches a reset (on the code before elastic resume every
resume below restarted the optimizer and missed by 4.7e-4 at step STOP + 2).

Three spawns (starting processes is the slow part on 2 cores): two ranks (the references
and the first halves of the DP=2, TP=2 and PP=2 runs), one rank (their resumes, a refused
change of global batch, the first halves of the DP=1 runs), two ranks (their resumes).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _multiproc import run_ranks
from _training import attempts, records, train_attempts

from cqk_megatron.config import ConfigError, load_config, validate
from cqk_megatron.errors import EXIT_REQUEUE

STEPS = 6
STOP = 3
TOLERANCE = 1e-5  # relative: DP=2 and DP=1 give the same loss curve to this
MEGATRON = ["train.engine=megatron"]
FULLY = [*MEGATRON, "train.optimizer_checkpoint=fully_reshardable"]
ZERO1 = ["train.engine=deepspeed", "train.zero_stage=1"]
DP_ENGINES = {  # the data-parallel changes
    "mg": MEGATRON,  # train.optimizer_checkpoint=dp_reshardable, the default
    "mgfull": FULLY,
    "ds": ZERO1,
    "z3": ["train.engine=deepspeed", "train.zero_stage=3"],  # its universal load is repaired
}
MODEL_PARALLEL = {  # TP=2 or PP=2 on two ranks, resumed on one
    "tp-mgfull": [*FULLY, "parallel.tensor_parallel=2"],
    "pp-mgfull": [*FULLY, "parallel.pipeline_parallel=2"],
    "tp-mg": [*MEGATRON, "parallel.tensor_parallel=2"],  # the optimizer restarts
    "tp-ds": [*ZERO1, "parallel.tensor_parallel=2"],  # the optimizer restarts
}
REFERENCES = {  # the uninterrupted TP=2 and PP=2 runs
    "straight-tp": [*MEGATRON, "parallel.tensor_parallel=2"],
    "straight-pp": [*MEGATRON, "parallel.pipeline_parallel=2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("elastic")
    same = [
        f"train.train_steps={STEPS}",
        "train.eval_interval=100",
        "train.checkpoint.save_interval=100",
        "train.checkpoint.hashes=false",
    ]
    stop = [f"train.resilience.exit_after_steps={STOP}"]
    two_ranks = [(name, [*same, *run]) for name, run in REFERENCES.items()]
    for name, engine in DP_ENGINES.items():
        two_ranks += [
            (f"straight-{name}", [*same, *engine]),
            (f"to1-{name}", [*same, *engine, *stop]),
        ]
    two_ranks += [(name, [*same, *run, *stop]) for name, run in MODEL_PARALLEL.items()]
    run_ranks(train_attempts, 2, str(root), two_ranks)

    one_rank = [("to1-mg", [*same, *MEGATRON, "train.global_batch_size=16"])]  # refused
    for name, engine in DP_ENGINES.items():
        one_rank += [(f"to1-{name}", [*same, *engine]), (f"to2-{name}", [*same, *engine, *stop])]
    for name, run in MODEL_PARALLEL.items():
        one_rank.append((name, [*same, *[o for o in run if not o.startswith("parallel.")]]))
    run_ranks(train_attempts, 1, str(root), one_rank)

    to2 = [(f"to2-{name}", [*same, *engine]) for name, engine in DP_ENGINES.items()]
    run_ranks(train_attempts, 2, str(root), to2)
    return root


def _losses(root: Path, name: str) -> list[float]:
    return [r["loss"] for r in records(root, name, "train")]


def _assert_same_losses(losses: list[float], expected: list[float]) -> None:
    assert len(losses) == len(expected) == STEPS
    for step, (loss, reference) in enumerate(zip(losses, expected, strict=True), 1):
        assert abs(loss - reference) <= TOLERANCE * abs(reference), (
            f"step {step}: {loss} vs {reference} (relative {abs(loss / reference - 1):.1e})"
        )


def _resumed(root: Path, name: str) -> dict:
    """The attempt that resumed run ``name`` (after its first, stopped one)."""
    found = attempts(root, name)
    assert found[0].get("exit") == EXIT_REQUEUE, found[0]
    assert found[-1].get("exit") == 0, found[-1]
    return found[-1]


@pytest.mark.parametrize("engine", DP_ENGINES)
@pytest.mark.parametrize("change", ["to1", "to2"])
def test_a_change_of_data_parallel_size_keeps_the_optimizer_state(runs, engine, change):
    name = f"{change}-{engine}"
    resumed = _resumed(runs, name)
    _assert_same_losses(_losses(runs, name), _losses(runs, f"straight-{engine}"))
    before, after = ("DP=2", "DP=1") if change == "to1" else ("DP=1", "DP=2")
    assert (
        f"at step {STOP} (optimizer state resharded from TP=1 PP=1 {before} to TP=1 PP=1 {after})"
        in resumed["stdout"]
    )
    assert "restarts" not in resumed["stderr"]
    # the universal checkpoint DeepSpeed's resume converted to is gone again
    assert not list((runs / name / "checkpoints").glob("*.universal"))


@pytest.mark.parametrize("change", ["tp", "pp"])
def test_megatrons_fully_reshardable_format_keeps_the_optimizer_from_tp2_or_pp2(runs, change):
    # each parameter's state is saved under the parameter's own sharded key
    name = f"{change}-mgfull"
    resumed = _resumed(runs, name)
    _assert_same_losses(_losses(runs, name), _losses(runs, f"straight-{change}"))
    before = "TP=2 PP=1 DP=1" if change == "tp" else "TP=1 PP=2 DP=1"
    assert f"(optimizer state resharded from {before} to TP=1 PP=1 DP=1)" in resumed["stdout"]


def test_megatrons_default_format_says_a_tp_change_restarts_the_optimizer_and_the_fix(runs):
    stderr = _resumed(runs, "tp-mg")["stderr"]
    assert "warning: the optimizer restarts from zero moments at step 3" in stderr
    assert "dp_reshardable format, which reshards over data-parallel ranks only" in stderr
    assert "train.optimizer_checkpoint=fully_reshardable" in stderr


def test_deepspeed_says_before_the_first_step_that_a_tp_change_restarts_the_optimizer(runs):
    resumed = _resumed(runs, "tp-ds")
    stdout, stderr = resumed["stdout"], resumed["stderr"]
    assert "TP=2 PP=1 DP=1 zero1 -> TP=1 PP=1 DP=1 zero1" in stderr
    assert "warning: the optimizer restarts from zero moments at step 3" in stderr
    assert "tensor- or pipeline-parallel ranks" in stderr
    # said at the start: the resume line (stdout, before step 4's line) names it too
    step_4 = re.search(r"^step +4/", stdout, re.MULTILINE)
    assert step_4 is not None, stdout
    assert stdout.index("weights only, fresh optimizer") < step_4.start()
    # the control: a fresh Adam's first update moves the losses after it far beyond the
    # tolerance the resumes above are held to
    losses, reference = _losses(runs, "tp-ds"), _losses(runs, "straight-tp")
    assert losses[:STOP] == pytest.approx(reference[:STOP], rel=TOLERANCE)
    after = [
        abs(loss / ref - 1)
        for loss, ref in zip(losses[STOP + 1 :], reference[STOP + 1 :], strict=True)
    ]
    assert max(after) > 100 * TOLERANCE, after


def test_a_changed_global_batch_is_refused_with_the_fix(runs):
    refused = attempts(runs, "to1-mg")[1]
    assert refused["error"] == "CheckpointError"
    message = refused["message"]
    assert "train.global_batch_size=8" in message and "has 16" in message
    assert "train.micro_batch_size" in message and "--resume none" in message
    # nothing moved: the next attempt (the right batch) resumed the same checkpoint
    assert "resumed from" in attempts(runs, "to1-mg")[2]["stdout"]


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["train.optimizer_checkpoint=fully"], "dp_reshardable"),  # the options are listed
        (["train.engine=deepspeed", "train.optimizer_checkpoint=fully_reshardable"], "megatron"),
    ],
)
def test_a_bad_optimizer_checkpoint_format_is_refused_naming_the_field(overrides, named):
    with pytest.raises(ConfigError) as refused:
        validate(load_config(None, overrides))
    assert "train.optimizer_checkpoint" in str(refused.value)
    assert named in str(refused.value)
