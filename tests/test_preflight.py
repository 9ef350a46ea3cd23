"""A bad run is refused before it queues: ``launch/submit.py`` (and ``cqk-train``) check
the data, tokenizer, sequence length, run folder, checkpoints and disk from files, print
one line and exit 2 before anything is written; and the data tools say what is wrong
with an input in the user's terms (lines counted from 1, the user's file names, the
text-unit option that would split a corpus), also through ``cqk-repro``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _overrides import replaced

from cqk_megatron.config import load_config
from cqk_megatron.data import DataError
from cqk_megatron.data.metadata import bin_path, idx_path, meta_path
from data_tools.demo_corpus import DemoSettings, build_demo

REPO = Path(__file__).resolve().parent.parent
SUBMIT = [sys.executable, str(REPO / "launch" / "submit.py")]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
RUN = [
    "--config",
    "configs/runs/tiny_cpu.yaml",
    "--profile",
    "configs/clusters/local.yaml",
    "--cluster",
    "local",
    "--tasks",
    "1",
]


def submit(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SUBMIT, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_demo(
        tmp_path_factory.mktemp("demo"),
        DemoSettings(max_bytes=150_000, vocab_size=700),
        progress=False,
    )


def _data(demo, *extra: str) -> list[str]:
    return [
        "data.mock=false",
        f"data.prefixes=[{demo.folder}/demo_text_document]",
        f"data.tokenizer={demo.folder}/tokenizer.model",
        "model.vocab_size=768",
        *extra,
    ]


def test_the_launcher_refuses_a_missing_data_prefix_before_any_run_folder_exists(tmp_path):
    root = tmp_path / "runs"
    out = submit(
        *RUN, f"log.root={root}", "data.mock=false", f"data.prefixes=[{tmp_path}/no/such_prefix]"
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"dataset '{tmp_path}/no/such_prefix' not found" in out.stderr
    assert "cqk data preprocess" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert "submitted" not in out.stdout
    assert not root.exists()


def test_the_launcher_refuses_bad_data_in_one_line_each(tmp_path, demo):
    root = tmp_path / "runs"
    prefix = f"{demo.folder}/demo_text_document"
    cases = {
        "names the file": (
            [f"data.prefixes=[{prefix}.bin]"],
            f"names a file; give the prefix without '.bin'/'.idx': '{prefix}'",
        ),
        "tokenizer too large": (
            ["model.vocab_size=256"],
            "has 700 tokens but model.vocab_size=256",
        ),
        "sequence longer than the data": (
            [f"model.seq_length={demo.tokens}"],
            f"the train split of '{prefix}' holds",
        ),
    }
    for name, (overrides, expected) in cases.items():
        out = submit(*RUN, f"log.root={root}", *replaced(_data(demo), *overrides))
        assert out.returncode == 2, (name, out.stdout, out.stderr)
        assert expected in out.stderr, (name, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, (name, out.stderr)
    assert not root.exists()


def test_an_index_of_another_dataset_with_the_same_size_is_refused(tmp_path, demo):
    """Same .bin, same number of documents and tokens, other document boundaries."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    from cqk_megatron.data.builder import check_prefix

    source = f"{demo.folder}/demo_text_document"
    prefix = tmp_path / "copy"
    shutil.copy(bin_path(source), bin_path(prefix))
    shutil.copy(meta_path(source), meta_path(prefix))
    index = IndexedDataset(source)
    lengths = index.sequence_lengths.astype(np.int64).copy()
    lengths[0], lengths[1] = lengths[0] + 5, lengths[1] - 5  # shift one boundary
    builder = IndexedDatasetBuilder(str(tmp_path / "scratch.bin"), dtype=index.index.dtype)
    tokens = np.fromfile(bin_path(source), dtype=index.index.dtype)
    start = 0
    for length in lengths:
        builder.add_document(tokens[start : start + length], [int(length)])
        start += length
    builder.finalize(str(idx_path(prefix)))
    assert bin_path(prefix).stat().st_size == bin_path(source).stat().st_size
    with pytest.raises(DataError, match="sha256 differs.*does not belong"):
        check_prefix(str(prefix))
    # a dataset recorded before the fingerprint: the EOD positions give it away
    meta = json.loads(meta_path(prefix).read_text())
    del meta["idx_sha256"]
    meta_path(prefix).write_text(json.dumps(meta))
    with pytest.raises(DataError, match="does not end with the EOD id .* does not belong"):
        check_prefix(str(prefix))
    assert check_prefix(source).sequences == len(lengths)  # the real pair still passes


def test_the_split_matrix_is_megatrons():
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    from cqk_megatron.data.checks import split_matrix

    for split in ("969,30,1", "99,1", "1", "0,1,0", "8,2,0", "1.5,0.5,1"):
        expected = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        assert split_matrix(split) == expected, split


def test_an_existing_run_folder_with_another_shape_is_refused_and_keeps_its_config(tmp_path):
    root = tmp_path / "runs"
    run_dir = root / "tiny-cpu"
    run_dir.mkdir(parents=True)
    recorded = load_config(REPO / "configs/runs/tiny_cpu.yaml", [f"log.root={root}"])
    from cqk_megatron.config import save_config

    save_config(recorded, run_dir / "config.yaml")
    before = (run_dir / "config.yaml").read_text()
    out = submit(*RUN, f"log.root={root}", "model.hidden_size=128")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "holds a run of another shape: model.hidden_size=64 (this config: 128)" in out.stderr
    assert "name=" in out.stderr and "--resume none" in out.stderr
    assert (run_dir / "config.yaml").read_text() == before
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]


def test_the_launcher_refuses_a_run_whose_checkpoints_all_fail_to_verify(tmp_path):
    from cqk_megatron.training.checkpoint import write_manifest

    root = tmp_path / "runs"
    checkpoints = root / "tiny-cpu" / "checkpoints"
    for step in (100, 200):
        folder = checkpoints / f"iter_{step:07d}"
        (folder / "model").mkdir(parents=True)
        (folder / "model" / "w.distcp").write_bytes(b"x" * 64)
        write_manifest(folder, step, with_hashes=False)
        (folder / "model" / "w.distcp").write_bytes(b"x" * 10)
    out = submit(*RUN, f"log.root={root}")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "none of the 2 checkpoint(s)" in out.stderr and "--resume none" in out.stderr
    assert "submitted" not in out.stdout
    assert sorted(p.name for p in (root / "tiny-cpu").iterdir()) == ["checkpoints"]


def _flip_a_byte(checkpoint: Path) -> Path:
    """One byte of the checkpoint's engine weights changed in place: every size still
    matches its manifest, only the sha256 tells."""
    path = checkpoint / "engine" / "pp0" / "ds" / "mp_rank_00_model_states.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def test_a_damaged_checkpoint_is_named_before_queueing_and_the_run_takes_one_that_verifies(
    tmp_path,
):
    """The launcher's pre-flight verifies by hash as the job's resume does: with the
    newest checkpoint damaged it names the one the run resumes from (and the job does
    resume from it); with every checkpoint damaged it refuses before queueing (exit 2),
    where it used to queue a job that then refused (the launcher's exit 1)."""
    root = tmp_path / "runs"
    run_dir = root / "flipped"
    checkpoints = run_dir / "checkpoints"
    run = [*RUN, f"log.root={root}", "name=flipped", "train.checkpoint.save_interval=10"]
    first = submit(*run, "train.train_steps=20")
    assert first.returncode == 0, first.stdout + first.stderr
    damaged = _flip_a_byte(checkpoints / "iter_0000020")

    out = submit(*run, "train.train_steps=30")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (
        f"flipped: note: skipping checkpoint: {damaged}: contents do not match the "
        "manifest's xxh3_128" in out.stderr
    ), out.stderr
    assert (
        "flipped: note: resuming from iter_0000010 (the newest that verifies, verified by "
        f"hash); the job moves the newer one(s) to {run_dir}/superseded/" in out.stderr
    ), out.stderr
    logs = "".join(p.read_text() for p in (run_dir / "submitit").glob("*_0_log.out"))
    assert f"resumed from {checkpoints}/iter_0000010 at step 10 (exactly)" in logs
    assert list(run_dir.glob("superseded/*/checkpoints/iter_0000020"))  # moved aside, not deleted
    assert "finished   yes: 30 steps" in submit("status", str(run_dir)).stdout

    for folder in checkpoints.glob("iter_*"):
        _flip_a_byte(folder)
    submissions = (run_dir / "jobs.jsonl").read_text()
    out = submit(*run, "train.train_steps=40")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "error: flipped: none of the" in out.stderr and "verifies" in out.stderr
    assert "submitted" not in out.stdout
    assert (run_dir / "jobs.jsonl").read_text() == submissions  # nothing queued


def test_the_pre_flight_accepts_good_data(demo):
    from cqk_megatron.data.checks import check_run_data

    check_run_data(load_config(None, _data(demo, "model.seq_length=64")))


# -- the data tools' messages -------------------------------------------------------------------


def _preprocess(tmp_path, demo, path: Path, *extra: str) -> subprocess.CompletedProcess:
    """``cqk-preprocess`` in this process (its ``main`` returns the exit code and prints
    what a user sees; one process start-up fewer per case)."""
    import contextlib
    import io

    from data_tools.preprocess import main

    argv = ["--input", str(path), "--tokenizer", str(demo.tokenizer)]
    argv += ["--output-prefix", str(tmp_path / "out"), "--workers", "1", "--quiet", *extra]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def test_jsonl_lines_without_the_text_field_are_refused_by_line(tmp_path, demo):
    path = tmp_path / "corpus.jsonl"
    lines = [{"text": "the first document"}, {"body": "no text here"}, {"text": "the third"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = _preprocess(tmp_path, demo, path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "1 of 3 records have no 'text' field (or a null one; the first at line 2)" in (
        out.stderr
    )
    assert "--skip-missing-text" in out.stderr and not bin_path(tmp_path / "out").exists()
    out = _preprocess(tmp_path, demo, path, "--skip-missing-text")
    assert out.returncode == 0, out.stderr
    assert "2 documents" in out.stdout


def test_malformed_lines_are_counted_from_one_and_named_by_the_users_file(tmp_path, demo):
    good = "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(5))
    cases = {
        "broken.jsonl": (good + '{"text": "cut\n', "line 6 is not valid JSON"),
        "numbers.jsonl": (good + '{"text": 7}\n', "line 6's 'text' is a number, not text"),
        "array.jsonl": (good + '["a"]\n', "line 6 holds a list, not a JSON object"),
    }
    for name, (text, expected) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        out = _preprocess(tmp_path, demo, path)
        assert out.returncode == 2, (name, out.stderr)
        assert expected in out.stderr, (name, out.stderr)
        for internal in ("Json(decode=True)", "row ", "pyarrow", "ArrowInvalid"):
            assert internal not in out.stderr, (name, out.stderr)
    # invalid UTF-8 is repaired into a temporary copy: errors still name the user's file
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(good.encode() + b'{"text": "caf\xe9"\n')
    out = _preprocess(tmp_path, demo, path)
    assert out.returncode == 2
    assert f"cannot read '{path}' as json: line 6 is not valid JSON" in out.stderr
    assert "repaired-" not in out.stderr and ".partial" not in out.stderr


def test_cqk_repro_passes_the_text_unit_on_and_refuses_a_one_document_corpus(tmp_path, demo):
    import dataclasses

    from cqk_megatron.data.metadata import read_meta
    from cqk_megatron.repro.data import CorpusOptions, resolve_data
    from cqk_megatron.repro.presets import PRESETS

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "".join(
            f"document {i}: the query and key move together, then attention.\n" for i in range(300)
        )
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cqk_megatron.repro",
            "--preset",
            "cpu-tiny",
            "--data",
            str(corpus),
            "--tokenizer",
            str(demo.tokenizer),
            "--out",
            str(tmp_path / "out"),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "gives the valid split 0 of the 1 documents" in out.stderr
    assert "--text-unit paragraph, which made 1 document(s)" in out.stderr
    assert "--text-unit line" in out.stderr
    assert not list((tmp_path / "out").glob("runs/*/metrics.jsonl"))  # nothing trained
    preset = dataclasses.replace(PRESETS["cpu-tiny"])
    data = resolve_data(
        str(corpus), str(demo.tokenizer), preset, tmp_path / "out2", CorpusOptions("line")
    )
    assert read_meta(data.prefix)["documents"] == 300
    assert read_meta(data.prefix)["text_unit"] == "line"


def test_cqk_train_runs_the_pre_flight_too(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cqk_megatron.train",
            f"log.root={tmp_path}/runs",
            f"data.prefixes=[{tmp_path}/missing]",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        f"error: dataset '{tmp_path}/missing' not found (no {tmp_path}/missing.bin or "
        f"{tmp_path}/missing.idx); make it with cqk data preprocess (or cqk data demo-corpus)"
    )
    assert not (tmp_path / "runs").exists()
