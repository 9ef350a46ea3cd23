"""``--print-config`` of ``cqk-train`` and of the launcher: the config that would run,
each value that is not the default followed by where it was set (a file of the include
tree, the cluster profile, the command line); and the one rule for where a run's folder
goes (``launch.resolve.runs_root``), printed at submission and found by ``status NAME``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cqk_megatron.config import (
    COMMAND_LINE,
    RunConfig,
    from_dict,
    load_config,
    load_config_traced,
    to_dict,
)
from launch.resolve import runs_root
from launch.resources import ClusterProfile

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
SUBMIT = [sys.executable, str(REPO / "launch" / "submit.py")]
TRAIN = [sys.executable, "-m", "cqk_megatron.train"]


def run(
    command: list[str], cwd: Path = REPO, timeout: float = 300, env: dict[str, str] = ENV
) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def comment_of(text: str, dotted: str) -> str | None:
    """The comment after ``dotted``'s line in --print-config's YAML (None: no comment)."""
    *sections, key = dotted.split(".")
    block = text
    for depth, section in enumerate(sections):  # train:, then   optimizer:, ...
        block = block.split(f"\n{'  ' * depth}{section}:\n", 1)[1]
    indent = "  " * len(sections)
    match = re.search(rf"^{indent}{key}: [^#\n]*(?:# (.*))?$", block, re.MULTILINE)
    assert match, f"no line for {dotted} in:\n{text}"
    return match.group(1)


def write_configs(tmp_path: Path) -> Path:
    """A run file that includes a model file, both setting values that differ from the
    defaults."""
    (tmp_path / "model.yaml").write_text("model:\n  num_layers: 3\n  hidden_size: 96\n")
    run_file = tmp_path / "run.yaml"
    run_file.write_text(
        "include: [model.yaml]\nname: traced\nmodel:\n  hidden_size: 64\n"
        "train:\n  optimizer:\n    lr: 0.002\n    weight_decay: 0.1\nlog:\n  root: runs_here\n"
    )
    return run_file


def test_train_print_config_names_the_file_or_command_line_of_every_changed_value(tmp_path):
    run_file = write_configs(tmp_path)
    out = run(
        [*TRAIN, "--config", str(run_file), "--print-config", "train.optimizer.lr=0.003"], tmp_path
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    included, own = os.path.normpath(tmp_path / "model.yaml"), os.path.normpath(run_file)
    assert comment_of(text, "model.num_layers") == f"{included}; default 4"
    assert comment_of(text, "model.hidden_size") == f"{own}; default 128"  # the file wins
    assert comment_of(text, "train.optimizer.lr") == f"{COMMAND_LINE}; default 0.0003"
    assert comment_of(text, "name") == f"{own}; default run"
    # equal to the default though the file sets it, and never set: no comment
    assert comment_of(text, "train.optimizer.weight_decay") is None
    assert comment_of(text, "train.train_steps") is None
    assert f"run folder {tmp_path / 'runs_here' / 'traced'} (log.root from {own})" in text
    # The YAML is the config that runs: it reads back as it.
    printed = from_dict(RunConfig, yaml.safe_load(text))
    assert printed == load_config(run_file, ["train.optimizer.lr=0.003"])
    assert not (tmp_path / "runs_here").exists()  # nothing trained, nothing written
    # A config that cannot run is printed, then refused as training would refuse it.
    out = run([*TRAIN, "--print-config", "parallel.tensor_parallel=3"], tmp_path)
    assert out.returncode == 2 and "parallel.tensor_parallel=3" in out.stderr


def test_a_key_set_under_its_old_name_is_traced_under_its_new_one(tmp_path):
    run_file = tmp_path / "run.yaml"
    run_file.write_text("train:\n  warmup_steps: 3\n")
    groups = [("cluster profile p.yaml", ["train={clip_grad: 0.5}"])]
    groups.append((COMMAND_LINE, ["train.adam_beta1=0.8"]))
    with pytest.warns(FutureWarning, match="'train.adam_beta1' is now 'train.optimizer.beta1'"):
        traced = load_config_traced(run_file, groups)
    assert traced.sources["train.schedule.warmup_steps"] == os.path.normpath(run_file)
    assert traced.sources["train.optimizer.clip_grad"] == "cluster profile p.yaml"
    assert traced.sources["train.optimizer.beta1"] == COMMAND_LINE
    assert not {"train.warmup_steps", "train.clip_grad", "train.adam_beta1"} & set(traced.sources)


def test_a_model_family_is_named_as_the_source_of_the_fields_it_fills_in():
    traced = load_config_traced(None, [(COMMAND_LINE, ["model.family=gpt2"])])
    assert traced.sources["model.family"] == COMMAND_LINE
    assert traced.sources["model.normalization"] == "by model.family=gpt2 (command line)"


def test_submit_print_config_names_the_profile_and_the_command_line(tmp_path):
    profile = tmp_path / "cluster.yaml"
    profile.write_text(f"gpus: false\ntasks_per_node: 1\nruns_root: {tmp_path}/shared\n")
    args = ["--config", "configs/runs/tiny_cpu.yaml", "--profile", str(profile)]
    out = run([*SUBMIT, *args, "--cluster", "local", "--print-config", "train.optimizer.lr=0.004"])
    assert out.returncode == 0, out.stderr
    where = f"cluster profile {profile} (runs_root)"
    assert comment_of(out.stdout, "log.root") == f"{where}; default runs"
    assert comment_of(out.stdout, "train.optimizer.lr") == f"{COMMAND_LINE}; default 0.0003"
    assert comment_of(out.stdout, "model.num_layers") == "configs/runs/tiny_cpu.yaml; default 4"
    assert f"run folder {tmp_path}/shared/tiny-cpu (log.root from {where})" in out.stdout
    assert "submitted" not in out.stdout and not (tmp_path / "shared").exists()
    # log.root on the command line wins over the profile's runs_root.
    out = run([*SUBMIT, *args, "--cluster", "local", "--print-config", f"log.root={tmp_path}/x"])
    assert comment_of(out.stdout, "log.root") == f"{COMMAND_LINE}; default runs"


def test_the_run_folder_rule_command_line_then_profile_then_the_run_config(tmp_path):
    run_file = write_configs(tmp_path)  # its log.root: runs_here
    profile = ClusterProfile(source="p.yaml", runs_root=str(tmp_path / "shared"))
    bare = ClusterProfile()

    def root(profile: ClusterProfile, overrides: list[tuple[str, list[str]]]) -> tuple[str, str]:
        return runs_root(load_config_traced(run_file, overrides), profile, overrides)

    by_profile = (str(tmp_path / "shared"), "cluster profile p.yaml (runs_root)")
    assert root(profile, []) == by_profile  # over the run file's log.root
    assert root(bare, []) == (str(Path("runs_here").resolve()), os.path.normpath(run_file))
    cli = [(COMMAND_LINE, [f"log.root={tmp_path}/mine"])]
    assert root(profile, cli) == (str(tmp_path / "mine"), COMMAND_LINE)
    sweep = [("sweep s.yaml run a", [f"log.root={tmp_path}/sw"]), (COMMAND_LINE, [])]
    assert root(profile, sweep) == (str(tmp_path / "sw"), "sweep s.yaml run a")
    # an override that sets something else leaves the profile's rule alone
    assert root(profile, [(COMMAND_LINE, ["train.optimizer.lr=0.1"])]) == by_profile
    assert to_dict(load_config_traced(run_file).config) == to_dict(load_config(run_file))


def test_status_finds_a_submitted_run_by_name_in_the_profile_s_runs_root(tmp_path):
    """The README's case: a profile's runs_root puts the run away from ``runs/``; the
    launcher says where, and ``status NAME`` finds it from another directory."""
    profile = tmp_path / "cluster.yaml"
    profile.write_text(f"gpus: false\ntasks_per_node: 1\nruns_root: {tmp_path}/shared\n")
    env = {**ENV, "XDG_STATE_HOME": str(tmp_path / "state")}  # the runs index of this test only
    out = run(
        [
            *SUBMIT,
            "--config",
            "configs/runs/tiny_cpu.yaml",
            "--profile",
            str(profile),
            "--cluster",
            "local",
            "name=found-by-name",
            "train.train_steps=2",
            "train.eval_interval=2",
            "train.checkpoint.save_interval=2",
        ],
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = tmp_path / "shared" / "found-by-name"
    assert f"-> {run_dir} (log.root from cluster profile {profile} (runs_root))" in out.stdout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    found = run([*SUBMIT, "status", "found-by-name"], elsewhere, timeout=60, env=env)
    assert found.returncode == 0, found.stdout + found.stderr
    assert f"run        {run_dir}" in found.stdout and "finished   yes" in found.stdout
    missing = run([*SUBMIT, "status", "never-submitted"], elsewhere, timeout=60, env=env)
    assert missing.returncode == 2
    assert "no run of that name was submitted from this account" in missing.stderr
