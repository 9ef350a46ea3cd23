"""Callbacks from outside the package: ``train(config, callbacks=[...])`` adds them to the
loop's own, a checkpoint keeps their ``state_dict`` and a resume hands it back, and
``on_error`` sees a failure before the run ends. The callbacks are defined here, in the
test file alone, as a user's would be in theirs; the real loop trains a tiny model on two
gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

from _multiproc import run_ranks
from _training import config_for, set_rank_env, synthetic_datasets

from cqk_megatron.run.checkpoint_files import latest_name
from cqk_megatron.training.callbacks.base import Callback
from cqk_megatron.training.checkpoint import load_trainer_state


class StepCounter(Callback):
    """Counts the steps it has seen, across resumes; rank 0 writes what it saw at the end."""

    def __init__(self, out: Path) -> None:
        self.count, self.restored, self.out = 0, None, out

    def post_step(self, run, outcome) -> None:
        self.count += 1

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = self.restored = state["count"]

    def post_train(self, run) -> None:
        if run.dp_rank == 0:
            seen = {"count": self.count, "restored": self.restored, "step": run.state.step}
            self.out.write_text(json.dumps(seen))


class FailAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def post_step(self, run, outcome) -> None:
        if run.state.step == self.step:
            raise RuntimeError(f"failed on purpose at step {self.step}")


class ErrorWitness(Callback):
    """Writes the error ``on_error`` was given (rank 0)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_error(self, run, error) -> None:
        if run.dp_rank == 0:
            self.out.write_text(f"{type(error).__name__}: {error} at step {run.state.step}")


def _train_twice_then_fail(rank, world_size, port, root) -> None:
    set_rank_env(rank, world_size, port)
    from cqk_megatron.training.loop import train

    root = Path(root)
    short = ["train.checkpoint.save_interval=2", "train.eval_interval=100"]
    for steps, seen in ((4, "first.json"), (7, "second.json")):
        config = config_for(str(root), "counted", [*short, f"train.train_steps={steps}"])
        outcome = train(
            config, datasets=synthetic_datasets(config), callbacks=[StepCounter(root / seen)]
        )
        assert outcome == 0, outcome
    config = config_for(str(root), "failing", [*short, "train.train_steps=5"])
    added = [FailAt(3), ErrorWitness(root / "error.txt")]
    try:
        train(config, datasets=synthetic_datasets(config), callbacks=added)
    except RuntimeError:
        pass
    else:
        raise AssertionError("the failing callback did not end the run")


def test_a_callback_added_by_the_caller_counts_steps_across_a_save_and_resume(tmp_path):
    run_ranks(_train_twice_then_fail, 2, str(tmp_path), timeout_s=600)
    first = json.loads((tmp_path / "first.json").read_text())
    assert first == {"count": 4, "restored": None, "step": 4}
    # the second run resumed from step 4's checkpoint, with the count saved in it
    second = json.loads((tmp_path / "second.json").read_text())
    assert second == {"count": 7, "restored": 4, "step": 7}
    checkpoints = tmp_path / "counted" / "checkpoints"
    state, _ = load_trainer_state(checkpoints / str(latest_name(checkpoints)))
    assert state.callbacks == {f"{__name__}.StepCounter": {"count": 7}}
    error = (tmp_path / "error.txt").read_text()
    assert error == "RuntimeError: failed on purpose at step 3 at step 3"
