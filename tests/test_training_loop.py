"""The training loop's contract with its callbacks (``training/loop.run_loop``), in one
process: the real step with a stand-in engine (the engine protocol is checked in
test_engine_protocol.py, and the real loop runs in test_training.py and the others), so
that the order of the hooks, an early stop and an error can be seen call by call."""

from __future__ import annotations

import pytest
import torch

from cqk_megatron.config import load_config
from cqk_megatron.errors import EXIT_REQUEUE
from cqk_megatron.training.callbacks.base import Callback, Callbacks, TrainingRun
from cqk_megatron.training.checkpoint import TrainerState
from cqk_megatron.training.engines.protocol import StepResult
from cqk_megatron.training.loop import run_loop
from cqk_megatron.training.resilience.phases import Bounds, judge_phases


class StandInEngine:
    """What the step asks of an engine: ``set_lr`` and ``train_step`` (no model)."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def train_step(self, batch) -> StepResult:
        self.batches.append(int(batch[0]["tokens"][0, 0]))
        return StepResult(loss=1.0, grad_norm=0.5, skipped=False)


class Recorder(Callback):
    """Appends ``name.hook@step`` to a shared list; ``stop_at``/``fail_at`` act at a step."""

    def __init__(self, name: str, calls: list[str], stop_at=None, fail_at=None) -> None:
        self.name, self.calls, self.stop_at, self.fail_at = name, calls, stop_at, fail_at

    def _note(self, hook: str, run: TrainingRun) -> None:
        self.calls.append(f"{self.name}.{hook}@{run.state.step}")

    def pre_train(self, run):
        self._note("pre_train", run)

    def pre_step(self, run):
        self._note("pre_step", run)

    def post_step(self, run, outcome):
        self._note("post_step", run)
        if run.state.step == self.fail_at:
            raise RuntimeError(f"{self.name} failed at step {run.state.step}")
        if run.state.step == self.stop_at:
            run.stop_reason = "asked"

    def post_train(self, run):
        self._note(f"post_train(finished={run.finished})", run)

    def on_error(self, run, error):
        self._note(f"on_error({error})", run)

    def close(self, run):
        self._note("close", run)


def _run(train_steps: int, start_step: int = 0) -> TrainingRun:
    config = load_config(None, ["train.global_batch_size=2", "train.micro_batch_size=2"])
    config.train.train_steps = train_steps
    samples = [{"tokens": torch.full((4,), i, dtype=torch.int64)} for i in range(100)]
    state = TrainerState(step=start_step, consumed_samples=2 * start_step)
    return TrainingRun(config, state, StandInEngine(), samples, samples, None, dp_rank=0, dp=1)


def test_each_hook_runs_on_every_callback_in_order_and_close_in_reverse():
    calls: list[str] = []
    run = _run(train_steps=2)
    outcome = run_loop(run, Callbacks([Recorder("a", calls), Recorder("b", calls)]))
    assert outcome == 0
    assert calls == [
        "a.pre_train@0",
        "b.pre_train@0",
        "a.pre_step@0",
        "b.pre_step@0",
        "a.post_step@1",
        "b.post_step@1",
        "a.pre_step@1",
        "b.pre_step@1",
        "a.post_step@2",
        "b.post_step@2",
        "a.post_train(finished=True)@2",
        "b.post_train(finished=True)@2",
        "b.close@2",
        "a.close@2",
    ]
    # the step reads the next global batch each time (samples 0-1, then 2-3)
    assert run.engine.batches == [0, 2]
    assert (run.state.consumed_samples, run.state.tokens) == (4, 4 * run.config.model.seq_length)


def test_a_stop_asked_in_post_step_ends_the_loop_after_that_step_with_the_requeue_code():
    calls: list[str] = []
    run = _run(train_steps=5)
    outcome = run_loop(run, Callbacks([Recorder("a", calls, stop_at=2), Recorder("b", calls)]))
    assert outcome == EXIT_REQUEUE
    assert run.state.step == 2 and run.stop_reason == "asked"
    # the rest of that step's post_step still runs (the save a stop waits for)
    assert calls[-6:] == [
        "a.post_step@2",
        "b.post_step@2",
        "a.post_train(finished=False)@2",
        "b.post_train(finished=False)@2",
        "b.close@2",
        "a.close@2",
    ]


def test_an_error_skips_post_train_tells_every_callback_and_closes_them():
    calls: list[str] = []
    run = _run(train_steps=5)
    callbacks = Callbacks([Recorder("a", calls, fail_at=3), Recorder("b", calls)])
    with pytest.raises(RuntimeError, match="a failed at step 3"):
        run_loop(run, callbacks)
    assert calls[-5:] == [
        "a.post_step@3",
        "a.on_error(a failed at step 3)@3",
        "b.on_error(a failed at step 3)@3",
        "b.close@3",
        "a.close@3",
    ]
    assert not [c for c in calls if "post_train" in c]


def test_a_run_resumed_at_its_last_step_trains_nothing_and_still_ends():
    calls: list[str] = []
    run = _run(train_steps=3, start_step=3)
    assert run_loop(run, Callbacks([Recorder("a", calls)])) == 0
    assert calls == ["a.pre_train@3", "a.post_train(finished=True)@3", "a.close@3"]
    assert run.engine.batches == []


def _state(step: int, age_s: float, bound_s: float, waiting: bool, phase: str = "step") -> dict:
    return {"step": step, "phase": phase, "age_s": age_s, "bound_s": bound_s, "waiting": waiting}


def test_the_phase_that_overran_names_the_rank_not_waiting_for_a_peer():
    states = {0: _state(12, 70.0, 60.0, waiting=True), 1: _state(12, 65.0, 60.0, waiting=False)}
    verdict = judge_phases(states, heartbeat_timeout_s=30.0)
    assert (verdict["kind"], verdict["ranks"]) == ("stuck", [1])
    assert verdict["reason"].startswith("overran phase 'step': 65.0 s, bound 60 s")


def test_ranks_that_only_wait_are_named_once_a_heartbeat_timeout_has_passed():
    bounds = Bounds(heartbeat_timeout_s=30.0, step_s=60.0)
    assert bounds.phase("step") == 60.0 and bounds.phase("step", first_step=True) == 300.0
    waiting = {0: _state(12, 80.0, 60.0, True), 1: _state(11, 85.0, 60.0, True)}
    assert judge_phases(waiting, heartbeat_timeout_s=30.0) is None  # 25 s over: not yet
    waiting[1] = _state(11, 95.0, 60.0, True)
    verdict = judge_phases(waiting, heartbeat_timeout_s=30.0)
    assert verdict["ranks"] == [1]  # the waiter furthest behind
    assert "(waiting in a collective)" in verdict["reason"]
    assert judge_phases({0: _state(3, 1e9, 60.0, False, phase="done")}, 30.0) is None
