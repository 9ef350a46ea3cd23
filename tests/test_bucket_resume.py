"""A Megatron-engine checkpoint in the ``dp_reshardable`` format holds its optimizer
state bucket by bucket. Resumed under other gradient buckets (``train.overlap_grad_reduce``
sizes them from the model, and the rule has changed: Megatron's 40M elements, now at
least 8 buckets a backward), it is refused at load with one line naming the checkpoint
and the fix, exit 2, nothing written; its weights then resume with a fresh optimizer.

2 gloo ranks, the tiny model; the old bucket is set through the engine's
``bucket_elements`` (a test-only knob: tests/_bucket_resume_workers.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from _bucket_resume_workers import train_with_bucket
from _multiproc import run_ranks
from _training import exits, records

from cqk_megatron.errors import EXIT_REFUSED, EXIT_REQUEUE

RUN = [
    "train.engine=megatron",
    "train.overlap_grad_reduce=true",
    "train.train_steps=4",
    "train.eval_interval=100",
    "train.checkpoint.save_interval=100",
    "train.checkpoint.hashes=false",
    "train.resilience.check_replicas_interval=0",
    "data.mock=true",
]
OLD_BUCKET = 40_000_000  # Megatron's rule before: one bucket for a model this small
STOP = 2
CHECKPOINT = f"checkpoints/iter_{STOP:07d}"


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and a hash of its bytes."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bucket-resume")
    r = str(root)
    stop = [*RUN, f"train.resilience.exit_after_steps={STOP}"]
    run_ranks(train_with_bucket, 2, r, "run", stop, OLD_BUCKET, "auto")
    saved = snapshot(root / "run")
    run_ranks(train_with_bucket, 2, r, "run", RUN, None, "auto")
    after_refusal = snapshot(root / "run")
    printed = (root / "run.err").read_text()
    weights = f"weights:{root / 'run' / CHECKPOINT}"
    run_ranks(train_with_bucket, 2, r, "run", RUN, None, weights)
    return {"root": root, "saved": saved, "after_refusal": after_refusal, "printed": printed}


def test_a_resume_under_other_buckets_is_refused_at_load(runs):
    root = runs["root"]
    assert exits(root, "run")[:2] == [str(EXIT_REQUEUE), str(EXIT_REFUSED)]
    # one line says why (the rest is the libraries' warnings), and no traceback
    printed = runs["printed"]
    assert "Traceback" not in printed
    errors = [line for line in printed.splitlines() if line.startswith("error")]
    assert len(errors) == 1, printed
    (line,) = errors
    checkpoint = root / "run" / CHECKPOINT
    assert line.startswith(f"error: checkpoint {checkpoint} ")
    assert "dp_reshardable" in line and "1 gradient bucket(s) of 123,200 elements" in line
    assert f"--resume weights:{checkpoint}" in line
    assert "train.optimizer_checkpoint=fully_reshardable" in line
    assert runs["after_refusal"] == runs["saved"]  # nothing written


def test_its_weights_resume_with_a_fresh_optimizer(runs):
    root = runs["root"]
    assert exits(root, "run")[2] == "0"
    steps = [r["step"] for r in records(root, "run", "train") if r["step"] > STOP]
    assert steps == [3, 4]
