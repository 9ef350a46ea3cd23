"""A run's records say what ran (``cqk_megatron/run/history.py``): each attempt that trains
a step records its settings and start step in ``history.jsonl`` and ``config.yaml``; a
resume takes a change that keeps the model's function and records it; a change of what
the model computes is refused (exit 2, nothing written); a finished run trains nothing and
changes nothing. The README's three training commands are run as written, each with a
shorter ``train.train_steps`` (and the run folder under the test's ``log.root``)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _multiproc import free_port
from _overrides import replaced

from cqk_megatron.analysis.ingest import ingest, run_summary

REPO = Path(__file__).resolve().parent.parent
ENV = {
    **os.environ,
    "PYTHONPATH": str(REPO),
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "PYTHONWARNINGS": "ignore",
}
STEPS = 6
SHORT = [f"train.train_steps={STEPS}", "train.checkpoint.save_interval=3", "train.eval_interval=3"]

# README.md's three training commands, after `cqk` / `torchrun`.
ONE_PROCESS = ["--config", "configs/runs/tiny_cpu.yaml"]
CHANGED_MODEL = [*ONE_PROCESS, "attention.steps=3", "train.optimizer.lr=6e-4"]
TP2_ZERO2 = [*ONE_PROCESS, "parallel.tensor_parallel=2", "train.zero_stage=2"]


def cqk_train(root: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "cqk_megatron", "train", *args, f"log.root={root}"]
    return _run(command)


def torchrun(root: Path, ranks: int, *args: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        f"--master-port={free_port()}",
        "-m",
        "cqk_megatron.train",
        *args,
        f"log.root={root}",
    ]
    return _run(command)


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=400, check=False
    )


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]


def recorded(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def snapshot(run_dir: Path) -> dict[str, str]:
    """Every file of a run folder and a digest of its contents."""
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """README's first command: the run ``tiny-cpu``, trained to the end."""
    root = tmp_path_factory.mktemp("runs")
    assert_ok(cqk_train(root, *ONE_PROCESS, *SHORT))
    return root


def test_the_readme_commands_under_distinct_names_leave_true_records(first_run):
    root = first_run
    assert_ok(cqk_train(root, *CHANGED_MODEL, *SHORT, "name=tiny-cpu-steps3"))
    assert_ok(torchrun(root, 4, *TP2_ZERO2, *SHORT, "name=tiny-cpu-tp2"))
    expected = {
        "tiny-cpu": {"steps": 1, "lr": 3e-3, "tp": 1, "zero": 1},
        "tiny-cpu-steps3": {"steps": 3, "lr": 6e-4, "tp": 1, "zero": 1},
        "tiny-cpu-tp2": {"steps": 1, "lr": 3e-3, "tp": 2, "zero": 2},
    }
    for name, want in expected.items():
        attempts = history(root / name)
        assert [a["start_step"] for a in attempts] == [0], name
        for config in (attempts[0]["config"], recorded(root / name)):
            assert config["attention"]["steps"] == want["steps"], name
            assert config["train"]["optimizer"]["lr"] == pytest.approx(want["lr"]), name
            assert config["parallel"]["tensor_parallel"] == want["tp"], name
            assert config["train"]["zero_stage"] == want["zero"], name


def test_a_finished_run_resubmitted_with_changes_trains_nothing_and_changes_nothing(first_run):
    run_dir = first_run / "tiny-cpu"
    before = snapshot(run_dir)
    changed = cqk_train(first_run, *CHANGED_MODEL, *SHORT)
    assert_ok(changed)
    assert "nothing to train, nothing changed" in changed.stdout
    assert "attention.steps 1 -> 3" in changed.stdout
    relaid = torchrun(first_run, 4, *TP2_ZERO2, *SHORT)
    assert_ok(relaid)
    assert "nothing to train, nothing changed" in relaid.stdout
    assert snapshot(run_dir) == before
    config = recorded(run_dir)
    assert (config["attention"]["steps"], config["parallel"]["tensor_parallel"]) == (1, 1)


def test_a_resume_that_changes_the_model_is_refused_and_writes_nothing(first_run):
    run_dir = first_run / "tiny-cpu"
    before = snapshot(run_dir)
    longer = replaced(SHORT, f"train.train_steps={STEPS + 3}")
    result = cqk_train(first_run, *CHANGED_MODEL, *longer)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert "attention.steps=1 (this config: 3)" in lines[0]
    assert "name=" in lines[0] and "train.init_from=" in lines[0]
    assert snapshot(run_dir) == before


def test_a_layout_change_on_resume_is_recorded_with_its_step(tmp_path):
    name = "tiny-cpu-relaid"
    assert_ok(cqk_train(tmp_path, *ONE_PROCESS, *SHORT, f"name={name}"))
    longer = replaced(SHORT, f"train.train_steps={STEPS + 3}", f"name={name}")
    result = torchrun(tmp_path, 2, *ONE_PROCESS, *longer, "parallel.tensor_parallel=2")
    assert_ok(result)
    attempts = history(tmp_path / name)
    assert [a["start_step"] for a in attempts] == [0, STEPS]
    changed = {c["key"]: (c["old"], c["new"]) for c in attempts[1]["changes"]}
    assert changed == {
        "parallel.tensor_parallel": (1, 2),
        "train.train_steps": (STEPS, STEPS + 3),
    }
    assert recorded(tmp_path / name)["parallel"]["tensor_parallel"] == 2
    # cqk analyze: each step's metrics are the settings that step ran under
    table = ingest([tmp_path]).table
    train = table[table["split"] == "train"].set_index("step")
    assert train.loc[STEPS, "settings"].split()[2] == "tp1"
    assert train.loc[STEPS + 1, "settings"].split()[2] == "tp2"
    settings = run_summary(table).set_index("run").loc[name, "settings"]
    assert f"(steps 1-{STEPS})" in settings and f"(steps {STEPS + 1}-{STEPS + 3})" in settings


# -- the history and the checks, without training (torch-free) ----------------------------


def _config(*overrides: str):
    from cqk_megatron.config import load_config

    return load_config(REPO / "configs" / "runs" / "tiny_cpu.yaml", list(overrides))


def test_a_restart_at_or_before_an_attempt_supersedes_it_and_steps_find_their_attempt(tmp_path):
    from cqk_megatron.run.history import attempt_of_step, read_history, record_attempt

    record_attempt(tmp_path, _config(), 0)
    record_attempt(tmp_path, _config("train.zero_stage=2"), 100)
    record_attempt(tmp_path, _config("parallel.tensor_parallel=2"), 150)
    # a resume from the checkpoint of step 100 again: the attempt from 150 trained steps
    # that the run's records no longer hold
    record_attempt(tmp_path, _config("train.micro_batch_size=1"), 100)
    attempts = read_history(tmp_path)
    assert [a.start_step for a in attempts] == [0, 100]
    assert attempts[1].changes == [{"key": "train.micro_batch_size", "old": 2, "new": 1}]
    assert attempt_of_step(attempts, 100) is attempts[0]
    assert attempt_of_step(attempts, 101) is attempts[1]
    assert recorded(tmp_path)["train"]["micro_batch_size"] == 1


def test_a_resume_from_a_checkpoint_of_another_model_function_is_refused(tmp_path):
    """The training side's own check, against the checkpoint's config (a run folder whose
    config.yaml is gone, or ``--skip-preflight``): the coupling's steps keep the shapes."""
    from cqk_megatron.config import save_config
    from cqk_megatron.run.checkpoint_files import CheckpointError, check_same_model

    save_config(_config(), tmp_path / "config.yaml")
    check_same_model(
        tmp_path, _config("parallel.tensor_parallel=2", "train.optimizer.lr=1e-4"), "fix"
    )
    with pytest.raises(
        CheckpointError, match=r"another model: attention.steps=1 \(this config: 3\)"
    ):
        check_same_model(tmp_path, _config("attention.steps=3"), "fix")


@pytest.mark.parametrize(
    "change",
    ["attention.differential_lambda_init=0.5", "attention.differential_norm=none"],
)
def test_a_resume_that_changes_the_differential_scoring_is_refused(tmp_path, change):
    """lambda_init is in lambda and in the output's (1 - lambda_init) factor; the norm is
    a term of the output: either changes what a differential model computes."""
    from cqk_megatron.config import save_config
    from cqk_megatron.run.checkpoint_files import CheckpointError, check_same_model

    differential = "attention.scoring=differential"
    save_config(_config(differential), tmp_path / "config.yaml")
    key = change.split("=")[0]
    with pytest.raises(CheckpointError, match=rf"another model: {key}="):
        check_same_model(tmp_path, _config(differential, change), "fix")


# Options of the registered couplings and scorings that only set a parameter's first value
# (a resumed run's checkpoint holds the parameter): a resume may change them.
INITIALISATION_ONLY = {"attention.dt_init"}


def test_every_option_a_coupling_or_scoring_takes_is_a_model_key_or_initialisation_only():
    """A registered variant's constructor options change what its module computes, unless
    they only initialise a parameter; a new option missing from ``changes.MODEL_KEYS``
    would let a resume change the model unnoticed (as lambda_init and the norm once did)."""
    from cqk_megatron.config.changes import MODEL_KEYS
    from cqk_megatron.variants import COUPLINGS, SCORINGS

    options = {
        f"attention.{field}"
        for variant in (*COUPLINGS.values(), *SCORINGS.values())
        for field in variant.options.values()
    }
    unlisted = sorted(options - set(MODEL_KEYS) - INITIALISATION_ONLY)
    assert not unlisted, f"add to config/changes.py's MODEL_KEYS (or here): {unlisted}"
    assert INITIALISATION_ONLY <= options  # names still registered


def test_starting_over_moves_the_history_and_config_aside(tmp_path):
    from cqk_megatron.run.checkpoint_files import apply_choice, choose_resume
    from cqk_megatron.run.history import read_history, record_attempt

    record_attempt(tmp_path, _config(), 0)
    moved = apply_choice(tmp_path, choose_resume(tmp_path / "checkpoints", "none"))
    assert "history.jsonl" in moved and "config.yaml" in moved
    assert read_history(tmp_path) == [] and not (tmp_path / "config.yaml").exists()
