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
from cqk_megatron.parallel.layout import ENGINE_SETTINGS, Layout, engine_name
from cqk_megatron.perf import plan

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
    assert engine_name("megatron", 3) == engine_name("megatron", 1) == "distopt"


def test_the_planner_and_training_agree_on_engine_names():
    # each training engine of the planner is the one that train.engine/zero_stage name
    assert set(ENGINE_SETTINGS) == set(plan.TRAINING_ENGINES)
    for name, settings in ENGINE_SETTINGS.items():
        assert engine_name(settings["engine"], settings["zero_stage"]) == name
        overrides = [f"train.{key}={value}" for key, value in settings.items()]
        assert plan.engine_of(load_config(None, overrides)) == name
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
