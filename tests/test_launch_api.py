"""``launch.api``, the launcher's local path as a library (``cqk-repro`` trains through it):
how a job's run ended, read from its run folder's records, and the refusals that come
before anything is submitted. Pure Python: no job is started here (``test_repro.py`` and
``test_model_families.py`` train through it end to end)."""

from __future__ import annotations

import pytest
from submitit.local.local import LocalJob

from cqk_megatron.config import ConfigError, load_config
from cqk_megatron.errors import EXIT_REQUEUE
from cqk_megatron.run.folder import append_event
from launch.api import LocalSubmission, outcome, submit_local
from launch.resolve import RunSpec
from launch.resources import Resources

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4"]


def _submission(tmp_path, job_id: str = "4242") -> LocalSubmission:
    config = load_config(None, [*TINY, "name=r", f"log.root={tmp_path}"])
    spec = RunSpec(config, Resources(nodes=1))
    job = LocalJob(folder=tmp_path / "r" / "submitit", job_id=job_id, tasks=[0])  # no process
    return LocalSubmission(spec, job, deadline_s=60)


@pytest.mark.parametrize(
    "records, expected",
    [
        ([], ("failed", None)),  # the job left no ending record (killed, or gave up early)
        ([("started", {}), ("stopped", {"exit": EXIT_REQUEUE})], ("stopped", EXIT_REQUEUE)),
        ([("started", {}), ("failed", {"reason": "disk full"})], ("failed", None)),
        ([("refused", {"reason": "held"})], ("refused", None)),
        # a "finished" event without the run's summary is not a finished run
        ([("started", {}), ("finished", {"exit": 0})], ("failed", 0)),
    ],
)
def test_outcome_is_the_jobs_last_ending_record(tmp_path, records, expected):
    submission = _submission(tmp_path)
    append_event(submission.run_dir, "stopped", job_id="1", exit=EXIT_REQUEUE)  # another job's
    for event, fields in records:
        append_event(submission.run_dir, event, job_id="4242", **fields)
    assert outcome(submission) == expected


def test_refusals_come_before_anything_is_written(tmp_path):
    config = load_config(None, [*TINY, "name=r", f"log.root={tmp_path}"])
    with pytest.raises(ConfigError, match="time_limit: time='soon' is not Slurm's syntax"):
        submit_local(config, 1, time_limit="soon")
    two_way = load_config(
        None, [*TINY, "name=r", f"log.root={tmp_path}", "parallel.tensor_parallel=2"]
    )
    with pytest.raises(ConfigError, match="world size 1"):
        submit_local(two_way, 1)
    assert not (tmp_path / "r").exists()
