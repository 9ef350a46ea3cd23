"""The one parallel layout (``cqk_megatron.parallel.layout.Layout``): the planner's and the
checkpoint's, and the ``layout.json`` that every checkpoint written so far carries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cqk_megatron.config import load_config
from cqk_megatron.parallel.layout import Layout
from cqk_megatron.perf import fit as plan
from cqk_megatron.training.engines import sharding_name, sharding_settings

# layout.json as the code before parallel_plan wrote it (json.dumps of the checkpoint's own
# Layout dataclass: tensor_parallel, pipeline_parallel, data_parallel, engine, zero_stage)
OLD_RECORDS = {
    '{"tensor_parallel": 2, "pipeline_parallel": 1, "data_parallel": 2, "engine": '
    '"deepspeed", "zero_stage": 2}': Layout(2, 1, 2, "zero2"),
    '{"tensor_parallel": 1, "pipeline_parallel": 2, "data_parallel": 1, "engine": '
    '"deepspeed", "zero_stage": 1}': Layout(1, 2, 1, "zero1"),
    '{"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 4, "engine": '
    '"megatron", "zero_stage": 1}': Layout(1, 1, 4, "distopt"),
}


@pytest.mark.parametrize("text", OLD_RECORDS)
def test_a_layout_json_of_the_old_code_reads_back_and_is_written_the_same(text):
    record = json.loads(text)
    layout = Layout.from_checkpoint_record(record)
    assert layout == OLD_RECORDS[text]
    assert layout.checkpoint_record() == record  # the same keys and values as before


def test_a_checkpoint_records_the_sharding_not_the_rest_of_the_layout():
    planned = Layout(2, 2, 2, "zero1", "full", vp=2, sequence_parallel=True)
    assert planned.sharding() == Layout(2, 2, 2, "zero1")
    assert Layout.from_checkpoint_record(planned.checkpoint_record()) == planned.sharding()
    # Megatron's distributed optimizer ignores train.zero_stage: any stage is the same one
    assert sharding_name("megatron", 3) == sharding_name("megatron", 1) == "distopt"


def test_the_planner_and_training_agree_on_sharding_names():
    # each optimizer sharding of the planner is the one that train.engine/zero_stage name
    for name in plan.TRAINING_SHARDINGS:
        settings = sharding_settings(name)
        assert sharding_name(settings["engine"], settings["zero_stage"]) == name
        overrides = [f"train.{key}={value}" for key, value in settings.items()]
        assert plan.sharding_of(load_config(None, overrides)) == name
    assert plan.Layout is Layout  # one class, not a look-alike


def test_same_layout_reads_an_old_checkpoints_layout_json(tmp_path):
    from cqk_megatron.parallel.process_groups import init_single_process
    from cqk_megatron.training import checkpoint

    init_single_process()  # TP = PP = DP = 1
    old = '{"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1, "engine": '
    (tmp_path / "layout.json").write_text(old + '"deepspeed", "zero_stage": 1}')
    assert checkpoint.same_layout(tmp_path, load_config(None, []))
    assert not checkpoint.same_layout(tmp_path, load_config(None, ["train.zero_stage=2"]))
    assert not checkpoint.same_layout(tmp_path, load_config(None, ["train.engine=megatron"]))
    (tmp_path / "layout.json").write_text(
        old.replace('"data_parallel": 1', '"data_parallel": 2') + '"deepspeed", "zero_stage": 1}'
    )
    assert not checkpoint.same_layout(tmp_path, load_config(None, []))


def test_the_layout_and_the_config_checks_import_no_torch():
    code = (
        "import sys\n"
        "import cqk_megatron.parallel.layout, cqk_megatron.config as c\n"
        "c.validate(c.load_config(None, ['parallel.pipeline_parallel=2']), 2)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_checkpoint_written_before_the_rename_resumes(tmp_path):
    """``Layout.engine`` became ``Layout.optimizer_sharding``; ``layout.json`` keeps the
    keys it always had ("engine" there is ``train.engine``), so a checkpoint saved before
    the rename (its ``layout.json`` as the old code wrote it) resumes in another layout."""
    from _multiproc import run_ranks
    from _training import exits, records, train_runs

    zero1 = ["train.engine=deepspeed", "train.zero_stage=1", "train.train_steps=4"]
    zero1 += ["train.eval_interval=100", "train.checkpoint.save_interval=100"]
    run_ranks(
        train_runs, 2, str(tmp_path), [("old", [*zero1, "train.resilience.exit_after_steps=2"])]
    )
    layout_json = tmp_path / "old" / "checkpoints" / "iter_0000002" / "layout.json"
    old = (
        '{"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 2, "engine": '
        '"deepspeed", "zero_stage": 1}'
    )
    assert json.loads(layout_json.read_text()) == json.loads(old)
    layout_json.write_text(old)  # byte for byte what the code before the rename wrote
    run_ranks(train_runs, 1, str(tmp_path), [("old", zero1)])  # DP=2 -> DP=1: resharded
    assert exits(tmp_path, "old")[-1] == "0"
    assert [r["step"] for r in records(tmp_path, "old", "train")][-2:] == [3, 4]
