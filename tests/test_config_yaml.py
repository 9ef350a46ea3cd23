"""One YAML reader (``config.read_yaml``) for run configs, sweeps and cluster profiles, and
one typed reader of what it read (``config.from_dict``): the same error format everywhere
(the file, the key, the fix), and sweeps and profiles as dataclasses."""

from __future__ import annotations

from pathlib import Path

import pytest

from cqk_megatron.config import ConfigError, load_config
from cqk_megatron.planner.sweep import Sweep, SweepSize, expand_sweep, load_sweep
from launch.resources import ClusterProfile, Resources, load_profile, merge_resources

LOADERS = {"run config": load_config, "sweep": expand_sweep, "cluster profile": load_profile}
SIZE = (
    "sizes:\n  tiny:\n    model: models/60m.yaml\n    tokens: 1000\n    lr: 1.0e-3\n"
    "    global_batch_size: 8\n    micro_batch_size: 2\n"
    "    layout: {tensor_parallel: 1, pipeline_parallel: 1, nodes: 1, gpus_per_node: 2}\n"
)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("kind", LOADERS)
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: [1,\n", "not valid YAML"),
        ("- a\n- b\n", "top level must be a mapping of keys"),
    ],
)
def test_every_yaml_file_has_the_same_errors(tmp_path, kind, text, message):
    path = write(tmp_path / "file.yaml", text)
    with pytest.raises(ConfigError, match=message) as error:
        LOADERS[kind](path)
    assert str(error.value).startswith(f"{path}: ")


@pytest.mark.parametrize("kind", LOADERS)
def test_a_missing_file_says_which_kind_it_is(tmp_path, kind):
    with pytest.raises(ConfigError, match="does not exist"):
        LOADERS[kind](tmp_path / "nonesuch.yaml")


def test_a_sweep_is_typed(tmp_path):
    sweep = load_sweep(write(tmp_path / "s.yaml", f"seeds: 3\n{SIZE}"))
    assert isinstance(sweep, Sweep) and isinstance(sweep.sizes["tiny"], SweepSize)
    assert sweep.sizes["tiny"].layout.world_size == 2 and sweep.sizes["tiny"].lr == 1e-3
    assert sweep.schedule.warmup_fraction == 0.01  # the defaults, typed too
    [run] = [r for r in expand_sweep(tmp_path / "s.yaml") if r["name"].endswith("standard-s3")]
    assert run["resources"]["world_size"] == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("lr: 1.0e-3", "lr: fast"), "'sizes.tiny.lr' must be float, got 'fast'"),
        (("nodes: 1", "nodes: two"), "'sizes.tiny.layout.nodes' must be int, got 'two'"),
        (("    lr: 1.0e-3\n", ""), "'sizes.tiny.lr' is required"),
        (
            ("tokens:", "tokenz:"),
            "unknown key 'sizes.tiny.tokenz'; did you mean 'sizes.tiny.tokens'",
        ),
        (("sizes:", "schedule: {warmup: 0.1}\nsizes:"), "unknown key 'schedule.warmup'"),
    ],
)
def test_a_bad_sweep_names_the_file_and_the_key(tmp_path, change, message):
    path = write(tmp_path / "s.yaml", SIZE.replace(*change))
    with pytest.raises(ConfigError, match=message) as error:
        expand_sweep(path)
    assert str(error.value).startswith(f"{path}: ")


def test_a_cluster_profile_is_typed(tmp_path):
    path = write(
        tmp_path / "p.yaml",
        "cluster: slurm\ngpus: true\ngpus_per_node: 4\ntime: 90\nenv: {OMP_NUM_THREADS: 8}\n",
    )
    profile = load_profile(path)
    assert isinstance(profile, ClusterProfile) and isinstance(profile.resources, Resources)
    assert profile.env == {"OMP_NUM_THREADS": "8"} and profile.resources.time == "90"
    assert profile.resources.gpus_per_node == 4 and profile.source == str(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpus: 3\n", "'gpus' must be bool, got 3"),
        ("setup: one line\n", "'setup' must be a list"),
        ("env: [A]\n", "'env' must be a mapping"),
        ("partion: h100\n", "unknown keys \\['partion'\\]; known: .*'partition'"),
        ("nodes: 0\n", "'nodes' must be at least 1, got 0"),
        ("time: soon\n", "time='soon' is not Slurm's syntax"),
        ("cluster: k8s\n", "cluster='k8s' is unknown"),
    ],
)
def test_a_bad_cluster_profile_names_the_file_and_the_key(tmp_path, text, message):
    path = write(tmp_path / "p.yaml", text)
    with pytest.raises(ConfigError, match=message) as error:
        load_profile(path)
    assert str(error.value).startswith(f"{path}: ")


def test_command_line_resources_are_typed_as_the_profiles():
    merged = merge_resources(Resources(), {"nodes": 2, "slurm_args": {"mail-type": 1}}, "cli")
    assert merged.nodes == 2 and merged.slurm_args == {"mail-type": "1"}
    with pytest.raises(ConfigError, match="cli: 'exclusive' must be bool"):
        merge_resources(Resources(), {"exclusive": "yes"}, "cli")
