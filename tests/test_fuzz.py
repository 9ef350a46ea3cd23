"""The fault and bad-input cases of issue 27, kept: bad configs (unknown, mistyped,
negative, non-finite fields, run names that are paths), bad data (truncated, foreign
indexes, a tokenizer larger than the vocabulary, random bytes to the data tools), damaged
checkpoints at resume (the launcher's pre-flight and a real resume) and at export,
exports with ``--overwrite`` that would delete a run, resume paths that name no
checkpoint, and SIGTERM to a training process (exit 75, resumable).

Every case asserts four things: the exit code; the first line of what the tool said (a
stable part of it); that nothing written before changed (the sha256 of every file of the
case's folder, run folder and data included, before and after; a case that legitimately
writes says which files, and how); and that no process is left (no child of this test,
and none naming the case's folder).

Cheap on purpose: the entry points' own ``main(argv)`` run in this process where they
refuse before training (``cqk-train`` and the launcher check a config and its files
before importing Megatron; ``_train`` and ``submit_group`` are replaced by a guard, so a
case that is not refused fails instead of training or queueing a job); a real process
only where a process is the point (a signal). One small run folder (two checkpoints) and
one small dataset are made once for the module and copied for each case that damages
them.

Elsewhere, not repeated here: the 2-rank full disk (tests/test_full_disk.py), ``--help``
of every command (tests/test_safety_inputs.py), the twin submission, relaunch and status
cases (tests/test_launch_status.py, tests/test_cancel.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest
from _overrides import replaced

from cqk_megatron.errors import EXIT_REFUSED, EXIT_REQUEUE
from cqk_megatron.run import checkpoint_files
from cqk_megatron.run.file_hash import file_sha256

REPO = Path(__file__).resolve().parent.parent
CONFIG = str(REPO / "configs" / "runs" / "tiny_cpu.yaml")
PROFILE = str(REPO / "configs" / "clusters" / "local.yaml")
ENV = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
TIMEOUT_S = 420  # a shared 2-core machine; nothing here asserts on time
RUN = "base"  # the prepared run's name
# The prepared run: 8 steps asked, stopped after 4 (exit 75, as a requeue would), with
# checkpoints at 2 and 4 verified by hash. A case that runs it again with this config
# resumes it (it is not finished) and changes no setting of it.
SETTINGS = [
    "train.train_steps=8",
    "train.checkpoint.save_interval=2",
    "train.eval_interval=100",
    "train.checkpoint.hashes=true",
    "train.resilience.exit_after_steps=4",
]


# -- what a case checks --------------------------------------------------------------------


def snapshot(folder: Path) -> dict[str, str]:
    """Every file (its sha256) and folder under ``folder``, by relative path."""
    found = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_symlink():
            found[name] = f"link to {os.readlink(path)}"
        elif path.is_file():
            found[name] = file_sha256(path)
        elif path.is_dir():
            found[name + "/"] = "folder"
    return found


def changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    gone = [f"removed {n}" for n in before if n not in after]
    made = [f"added {n}" for n in after if n not in before]
    edited = [f"changed {n}" for n in before if n in after and before[n] != after[n]]
    return gone + made + edited


def processes_left(before: set[int], marker: str) -> list[str]:
    """Processes started since ``before`` that are still alive: children of this test, or
    any naming ``marker`` (a local job's tasks run in sessions of their own)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        if child.pid not in before:
            found.append(child)
    for process in psutil.process_iter(["cmdline"]):
        if marker in " ".join(process.info["cmdline"] or []) and process.pid != os.getpid():
            found.append(process)
    alive = []
    for process in found:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid}: {' '.join(process.cmdline())[:200]}")
        except psutil.NoSuchProcess:
            continue
    return alive


@dataclass
class Outcome:
    code: int
    err: str
    out: str

    @property
    def first_line(self) -> str:
        """The first line of the error (warnings may come before it), else of all said."""
        lines = [x for x in self.err.splitlines() if x.strip()]
        errors = [x for x in lines if "error: " in x]
        return (errors or lines or [""])[0]


class Watch:
    """A case's folder and processes before it ran, to compare with after."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.before = snapshot(folder)
        self.children = {p.pid for p in psutil.Process().children(recursive=True)}

    def assert_unchanged(self, allowed: Callable[[str], bool] = lambda change: False) -> None:
        found = [c for c in changes(self.before, snapshot(self.folder)) if not allowed(c)]
        assert not found, f"files changed under {self.folder}: {found}"

    def assert_no_process_left(self) -> None:
        left = processes_left(self.children, str(self.folder))
        assert not left, f"processes left: {left}"


def check(outcome: Outcome, code: int, first: str, *more: str) -> None:
    """The exit code, ``first`` in the first line said, each of ``more`` somewhere."""
    said = f"exit {outcome.code}\nstderr:\n{outcome.err}\nstdout:\n{outcome.out}"
    assert outcome.code == code, said
    assert first in outcome.first_line, said
    for text in more:
        assert text in outcome.err, said
    assert "Traceback" not in outcome.err, said


# -- the entry points, in this process -----------------------------------------------------


def _guard(what: str) -> Callable:
    def refuse(*args, **kwargs):
        raise AssertionError(f"the case was not refused: it would {what}")

    return refuse


def cqk_train(argv: list[str], capsys, monkeypatch) -> Outcome:
    """``cqk-train ARGV``; it must refuse before training (else the guard fails the case)."""
    from cqk_megatron import train

    monkeypatch.setattr(train, "_train", _guard("train"))
    capsys.readouterr()
    code = train.main(argv)
    said = capsys.readouterr()
    return Outcome(code, said.err, said.out)


def launcher(argv: list[str], capsys, monkeypatch) -> Outcome:
    """``launch/submit.py ARGV`` on this machine; it must not queue a job."""
    from launch import submit

    monkeypatch.setattr(submit, "submit_group", _guard("queue a job"))
    capsys.readouterr()
    code = submit.main(["--profile", PROFILE, "--cluster", "local", "--tasks", "1", *argv])
    said = capsys.readouterr()
    return Outcome(code, said.err, said.out)


def convert(argv: list[str], capsys) -> Outcome:
    from cqk_megatron.cli import convert as cli

    capsys.readouterr()
    code = cli.main(argv)
    said = capsys.readouterr()
    return Outcome(code, said.err, said.out)


def data_tool(main: Callable[[list[str]], int], argv: list[str], capsys) -> Outcome:
    capsys.readouterr()
    code = main(argv)
    said = capsys.readouterr()
    return Outcome(code, said.err, said.out)


# -- the shared run folder and dataset -----------------------------------------------------


@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory) -> Path:
    """``RUN`` trained for 4 of its 8 steps (mock data) by a real ``cqk-train``: its folder."""
    root = tmp_path_factory.mktemp("prepared") / "runs"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cqk_megatron.train",
            "--config",
            CONFIG,
            f"log.root={root}",
            f"name={RUN}",
            *SETTINGS,
        ],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert out.returncode == EXIT_REQUEUE, out.stderr[-3000:]
    run_dir = root / RUN
    assert [p.name for p in checkpoint_files.iterations(run_dir / "checkpoints")] == [
        "iter_0000002",
        "iter_0000004",
    ]
    return run_dir


DOCS = 120
WORDS = (
    "the a model run folder data token step loss checkpoint save resume export refuse "
    "config field value disk rank job signal launcher index bin meta tokenizer vocabulary "
    "sequence batch learning rate warmup layer head hidden attention coupled query key"
).split()


@pytest.fixture(scope="module")
def prepared_data(tmp_path_factory) -> Path:
    """A small corpus tokenized by ``cqk-preprocess`` with its own tokenizer: the folder
    (``docs.jsonl``, ``spm.model``, ``docs_text_document.{bin,idx,meta.json}``)."""
    from data_tools import preprocess
    from data_tools import tokenizer as tokenizer_tool

    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(27)
    with (folder / "docs.jsonl").open("w") as out:
        for i in range(DOCS):
            words = rng.choice(WORDS, size=int(rng.integers(20, 60)))
            out.write(json.dumps({"text": " ".join(words) + f" {i}."}) + "\n")
    recipe = tokenizer_tool.TokenizerRecipe(
        vocab_size=320, sample_documents=DOCS, character_coverage=1.0, threads=1
    )
    tokenizer_tool.train_tokenizer([str(folder / "docs.jsonl")], folder / "spm", recipe)
    preprocess.preprocess(
        [str(folder / "docs.jsonl")],
        folder / "docs_text_document",
        folder / "spm.model",
        workers=1,
        progress=False,
    )
    return folder


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of the prepared run in ``tmp_path/runs``; its folder."""
    target = tmp_path / "runs" / RUN
    shutil.copytree(run_dir, target)
    return target


def copy_data(data: Path, tmp_path: Path) -> Path:
    target = tmp_path / "data"
    shutil.copytree(data, target)
    return target


def data_overrides(data: Path, prefix: str = "docs_text_document") -> list[str]:
    return [
        "data.mock=false",
        f"data.prefixes=[{data / prefix}]",
        f"data.tokenizer={data / 'spm.model'}",
        "model.vocab_size=384",
    ]


# -- bad configs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigCase:
    overrides: tuple[str, ...]
    first: str  # in the first line said
    names: str = ""  # somewhere in the message: the field (and value) at fault


CONFIG_CASES = {
    "unknown field": ConfigCase(
        ("train.lrr=0.1",), "unknown key 'train.lrr'", "train.optimizer.lr"
    ),
    "wrong type": ConfigCase(
        ("train.train_steps=many",), "'train.train_steps' must be int, got 'many'"
    ),
    "negative hidden size": ConfigCase(
        ("model.hidden_size=-64",), "invalid config", "model.hidden_size"
    ),
    "negative micro batch": ConfigCase(
        ("train.micro_batch_size=-2",), "invalid config", "train.micro_batch_size"
    ),
    "nan lr": ConfigCase(("train.optimizer.lr=.nan",), "invalid config", "train.optimizer.lr"),
    "inf lr": ConfigCase(("train.optimizer.lr=.inf",), "invalid config", "train.optimizer.lr"),
    "-inf min lr": ConfigCase(
        ("train.schedule.min_lr=-.inf",), "invalid config", "train.schedule.min_lr"
    ),
    "inf weight decay": ConfigCase(
        ("train.optimizer.weight_decay=.inf",), "invalid config", "train.optimizer.weight_decay"
    ),
    "inf save timeout": ConfigCase(
        ("train.resilience.save_timeout_s=.inf",),
        "invalid config",
        "train.resilience.save_timeout_s",
    ),
    "name ../x": ConfigCase(
        ("name=../escape",), "invalid config", "name='../escape' is not a run name"
    ),
    "name /x": ConfigCase(
        ("name={tmp}/abs",), "invalid config", "name='{tmp}/abs' is not a run name"
    ),
    "name a/b": ConfigCase(("name=a/b",), "invalid config", "name='a/b' is not a run name"),
    "name empty": ConfigCase(("name=''",), "invalid config", "name='' is not a run name"),
    "name null": ConfigCase(("name=",), "'name' must be str, got None"),
    "name with a tab": ConfigCase(
        ("name='a\tb'",), "invalid config", "name='a\\tb' is not a run name"
    ),
    "missing data prefix": ConfigCase(
        ("data.mock=false", "data.prefixes=[{tmp}/no/such_prefix]"),
        "dataset '{tmp}/no/such_prefix' not found",
        "cqk data preprocess",
    ),
}
ENTRY_POINTS = {"cqk-train": cqk_train, "launcher": launcher}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(
    "case",
    [pytest.param(case, id=name) for name, case in CONFIG_CASES.items()],
)
def test_a_bad_config_is_refused_and_nothing_is_written(
    case, entry, prepared_run, tmp_path, capsys, monkeypatch
):
    copy_run(prepared_run, tmp_path)
    watch = Watch(tmp_path)
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in case.overrides]
    settings = replaced([f"log.root={tmp_path / 'runs'}", f"name={RUN}", *SETTINGS], *overrides)
    outcome = ENTRY_POINTS[entry](["--config", CONFIG, *settings], capsys, monkeypatch)
    first, names = (s.replace("{tmp}", str(tmp_path)) for s in (case.first, case.names))
    check(outcome, EXIT_REFUSED, first, names)
    watch.assert_unchanged()
    watch.assert_no_process_left()


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(
    prepared_data, tmp_path, capsys, monkeypatch
):
    data = copy_data(prepared_data, tmp_path)
    watch = Watch(tmp_path)
    overrides = [*data_overrides(data)[:-1], "model.vocab_size=256"]
    argv = ["--config", CONFIG, f"log.root={tmp_path / 'runs'}", *SETTINGS, *overrides]
    outcome = cqk_train(argv, capsys, monkeypatch)
    check(outcome, EXIT_REFUSED, "has 320 tokens but model.vocab_size=256")
    watch.assert_unchanged()
    watch.assert_no_process_left()


# (run file, first line): a key given twice in a run file, which YAML would silently merge
# away (the second ``train:`` replaced the first whole: train_steps went back to the
# included 200)
DUPLICATE_CASES = {
    "section twice": (
        "include: [{config}]\ntrain:\n  train_steps: 7\n  checkpoint:\n    save_interval: 7\n"
        "model:\n  hidden_size: 64\ntrain:\n  eval_iters: 2\n",
        "key 'train' is given twice (lines 2 and 8)",
    ),
    "key twice in a section": (
        "include: [{config}]\ntrain:\n  train_steps: 7\n  eval_iters: 2\n  train_steps: 9\n",
        "key 'train.train_steps' is given twice (lines 3 and 5)",
    ),
    "key twice in a group of a section": (
        "include: [{config}]\ntrain:\n  checkpoint:\n    save_interval: 7\n    keep_last: 2\n"
        "    save_interval: 9\n",
        "key 'train.checkpoint.save_interval' is given twice (lines 4 and 6)",
    ),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(
    ("text", "first"), list(DUPLICATE_CASES.values()), ids=list(DUPLICATE_CASES)
)
def test_a_key_given_twice_in_a_run_file_is_refused(
    text, first, entry, tmp_path, capsys, monkeypatch
):
    run_file = tmp_path / "run.yaml"
    run_file.write_text(text.replace("{config}", CONFIG))
    watch = Watch(tmp_path)
    argv = ["--config", str(run_file), f"log.root={tmp_path / 'runs'}"]
    outcome = ENTRY_POINTS[entry](argv, capsys, monkeypatch)
    check(outcome, EXIT_REFUSED, f"{run_file}: {first}", "merge them into one")
    watch.assert_unchanged()
    watch.assert_no_process_left()


# (overrides, first line): a key given twice on the command line, where the later would
# silently replace the earlier
REPEAT_CASES = {
    "key twice": (
        ("train.optimizer.lr=1e-3", "train.checkpoint.save_interval=3", "train.optimizer.lr=2e-3"),
        "command line: key 'train.optimizer.lr' is given twice, by override 1 "
        "'train.optimizer.lr=1e-3' and override 3 'train.optimizer.lr=2e-3'",
    ),
    "section, then a key it holds": (
        ("train={optimizer: {lr: 1e-3}}", "train.optimizer.lr=2e-3"),
        "command line: key 'train.optimizer.lr' is given twice (the section 'train' holds it), "
        "by override 1 'train={optimizer: {lr: 1e-3}}' and override 2 'train.optimizer.lr=2e-3'",
    ),
    "old and new name of a key moved into a section": (
        ("train.lr=1e-3", "train.optimizer.lr=2e-3"),
        "command line: key 'train.optimizer.lr' is given twice, by override 1 'train.lr=1e-3' "
        "and override 2 'train.optimizer.lr=2e-3'",
    ),
    "old and new name": (
        ("backend=local", "transformer_impl=local"),
        "command line: key 'transformer_impl' is given twice, by override 1 'backend=local' "
        "and override 2 'transformer_impl=local'",
    ),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(
    ("overrides", "first"), list(REPEAT_CASES.values()), ids=list(REPEAT_CASES)
)
def test_a_key_given_twice_on_the_command_line_is_refused(
    overrides, first, entry, tmp_path, capsys, monkeypatch
):
    watch = Watch(tmp_path)
    argv = ["--config", CONFIG, *overrides, f"log.root={tmp_path / 'runs'}"]
    outcome = ENTRY_POINTS[entry](argv, capsys, monkeypatch)
    check(outcome, EXIT_REFUSED, first, "give each key once")
    assert len(outcome.err.strip().splitlines()) == 1, outcome.err
    watch.assert_unchanged()
    watch.assert_no_process_left()


def test_a_key_given_twice_to_cqk_torchrun_is_refused_before_any_rank_starts(tmp_path):
    """torchrun ends rank 0 as soon as another rank exits: the refusal is said once, by
    ``cqk torchrun`` itself, before it starts the ranks."""
    watch = Watch(tmp_path)
    command = [sys.executable, "-m", "cqk_megatron", "torchrun", "--nproc-per-node", "2"]
    training = ["-m", "cqk_megatron.train", "--config", CONFIG, f"log.root={tmp_path / 'runs'}"]
    out = subprocess.run(
        [*command, *training, "train.optimizer.lr=1e-3", "train.optimizer.lr=2e-3"],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    said = f"exit {out.returncode}\nstderr:\n{out.stderr}\nstdout:\n{out.stdout}"
    assert out.returncode == EXIT_REFUSED, said
    assert out.stderr.splitlines() == [
        "error: command line: key 'train.optimizer.lr' is given twice, by override 2 "
        "'train.optimizer.lr=1e-3' and override 3 'train.optimizer.lr=2e-3'; the later would "
        "silently replace the earlier: give "
        "each key once"
    ], said
    watch.assert_unchanged()
    watch.assert_no_process_left()


SWEEP = str(REPO / "configs" / "sweeps" / "ladder_smoke.yaml")


def test_a_key_given_twice_after_a_sweep_is_refused(tmp_path, capsys, monkeypatch):
    watch = Watch(tmp_path)
    argv = ["--sweep", SWEEP, "--tasks", "2", f"log.root={tmp_path}"]  # its TP=2 size
    outcome = launcher(
        [*argv, "train.optimizer.lr=1e-3", "train.optimizer.lr=2e-3"], capsys, monkeypatch
    )
    check(
        outcome,
        EXIT_REFUSED,
        "command line: key 'train.optimizer.lr' is given twice, by override 2",
    )
    watch.assert_unchanged()


def test_the_command_line_may_set_once_what_a_sweep_sets(tmp_path, capsys, monkeypatch):
    """The sweep's own overrides (its common keys, each size's) and the profile's are the
    launcher's composition: a key that the command line sets once wins over them."""
    from launch import submit

    argv = ["--sweep", SWEEP, "--profile", PROFILE, "--cluster", "local", f"log.root={tmp_path}"]
    assert submit.main([*argv, "model.seq_length=64", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("seq_length: 64  # command line") == 4, printed


# -- bad data ------------------------------------------------------------------------------


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _truncate_bin(data: Path) -> None:
    path = data / "docs_text_document.bin"
    _truncate(path, path.stat().st_size - 64)


def _truncate_idx(data: Path) -> None:
    path = data / "docs_text_document.idx"
    _truncate(path, path.stat().st_size - 16)


def _foreign_index(data: Path, keep_meta: bool) -> None:
    """The index of the same corpus with its documents in reverse order (as a second
    preprocessing of it would give): the same size, other document boundaries."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    prefix = data / "docs_text_document"
    index = IndexedDataset(str(prefix))
    lengths = index.sequence_lengths.astype(np.int64)[::-1]
    tokens = np.fromfile(f"{prefix}.bin", dtype=index.index.dtype)
    builder = IndexedDatasetBuilder(str(data / "scratch.bin"), dtype=index.index.dtype)
    start = 0
    for length in lengths:
        builder.add_document(tokens[start : start + length], [int(length)])
        start += length
    size = Path(f"{prefix}.idx").stat().st_size
    builder.finalize(f"{prefix}.idx")
    (data / "scratch.bin").unlink()
    assert Path(f"{prefix}.idx").stat().st_size == size
    if not keep_meta:
        Path(f"{prefix}.meta.json").unlink()


DATA_CASES = {
    "truncated .bin": (_truncate_bin, "docs_text_document.bin has "),
    "truncated .idx": (
        _truncate_idx,
        "docs_text_document.idx is not the index docs_text_document.meta.json recorded",
    ),
    "foreign same-size .idx with meta": (
        lambda data: _foreign_index(data, keep_meta=True),
        "does not belong",
    ),
    "foreign same-size .idx without meta": (
        lambda data: _foreign_index(data, keep_meta=False),
        "does not end with the EOD id",
    ),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(("damage", "first"), list(DATA_CASES.values()), ids=list(DATA_CASES))
def test_bad_data_is_refused_before_training(
    damage, first, entry, prepared_data, tmp_path, capsys, monkeypatch
):
    data = copy_data(prepared_data, tmp_path)
    damage(data)
    watch = Watch(tmp_path)
    argv = ["--config", CONFIG, f"log.root={tmp_path / 'runs'}", *SETTINGS, *data_overrides(data)]
    outcome = ENTRY_POINTS[entry](argv, capsys, monkeypatch)
    check(outcome, EXIT_REFUSED, first)
    watch.assert_unchanged()
    watch.assert_no_process_left()


def _noise(data: Path, name: str, size: int = 20_000) -> Path:
    path = data / name
    path.write_bytes(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    return path


def _preprocess(data: Path, source: Path) -> tuple[Callable, list[str]]:
    from data_tools import preprocess

    argv = ["--input", str(source), "--tokenizer", str(data / "spm.model"), "--workers", "1"]
    return preprocess.main, [*argv, "--output-prefix", str(data / "new" / "out"), "--quiet"]


def _train_tokenizer(data: Path, source: Path) -> tuple[Callable, list[str]]:
    from data_tools import tokenizer

    out = data / "new" / "tok"
    argv = ["--input", str(source), "--output-prefix", str(out), "--vocab-size", "300"]
    return tokenizer.main, argv


def _data_stats(data: Path, source: Path) -> tuple[Callable, list[str]]:
    from data_tools import stats

    Path(f"{source}.bin").write_bytes(source.read_bytes())
    Path(f"{source}.idx").write_bytes(source.read_bytes()[:2000])
    return stats.main, [str(source)]


# (tool, input file, first line): random bytes where text, JSON lines or a dataset belong
NOISE_CASES = {
    "cqk-preprocess, .txt": (_preprocess, "noise.txt", "error: input '{path}' is not text: "),
    "cqk-preprocess, .jsonl": (
        _preprocess,
        "noise.jsonl",
        "error: input '{path}' is not text: ",
    ),
    "cqk-train-tokenizer, .txt": (
        _train_tokenizer,
        "noise.txt",
        "error: input '{path}' is not text: ",
    ),
    "cqk-data-stats": (
        _data_stats,
        "noise_text_document",
        "error: dataset '{path}': {path}.idx is not a readable Megatron index",
    ),
}


@pytest.mark.parametrize(
    ("tool", "name", "first"), list(NOISE_CASES.values()), ids=list(NOISE_CASES)
)
def test_the_data_tools_refuse_random_bytes(tool, name, first, prepared_data, tmp_path, capsys):
    """One line naming the file, exit 2, nothing written (it was tokenized with a warning
    for 20,655 bad sequences)."""
    data = copy_data(prepared_data, tmp_path)
    source = _noise(data, name)
    main, argv = tool(data, source)
    watch = Watch(tmp_path)
    outcome = data_tool(main, argv, capsys)
    check(outcome, EXIT_REFUSED, first.replace("{path}", str(source)))
    watch.assert_unchanged()
    watch.assert_no_process_left()


def _truncated_gzip(data: Path, name: str) -> Path:
    """The case's corpus gzipped, then cut to half its bytes (an interrupted copy)."""
    import gzip

    path = data / name
    packed = gzip.compress((data / "docs.jsonl").read_bytes())
    path.write_bytes(packed[: len(packed) // 2])
    return path


def _not_gzip(data: Path, name: str) -> Path:
    path = data / name
    path.write_bytes((data / "docs.jsonl").read_bytes())  # named .gz, never compressed
    return path


def _truncated_parquet(data: Path, name: str) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = data / name
    texts = [json.loads(line)["text"] for line in (data / "docs.jsonl").read_text().splitlines()]
    pq.write_table(pa.table({"text": texts}), path)
    path.write_bytes(path.read_bytes()[:-100])  # its footer cut off
    return path


# (make the input, its name, first line): inputs that cannot be read to their end
UNREADABLE_CASES = {
    "truncated .jsonl.gz": (
        _truncated_gzip,
        "docs.jsonl.gz",
        "error: input '{path}' is not a readable .gz file: its compressed data ends before "
        "the end-of-stream marker (truncated?)",
    ),
    "truncated .txt.gz": (
        _truncated_gzip,
        "docs.txt.gz",
        "error: input '{path}' is not a readable .gz file: its compressed data ends",
    ),
    ".gz that is not gzip": (
        _not_gzip,
        "docs.jsonl.gz",
        "error: input '{path}' is not a readable .gz file: Not a gzipped file",
    ),
    "parquet without its footer": (
        _truncated_parquet,
        "docs.parquet",
        "error: cannot read '{path}' as parquet: ",
    ),
    "random bytes as parquet": (
        lambda data, name: _noise(data, name),
        "noise.parquet",
        "error: cannot read '{path}' as parquet: ",
    ),
}


@pytest.mark.parametrize("tool", [_preprocess, _train_tokenizer], ids=["preprocess", "tokenizer"])
@pytest.mark.parametrize(
    ("make", "name", "first"), list(UNREADABLE_CASES.values()), ids=list(UNREADABLE_CASES)
)
def test_the_data_tools_name_an_input_they_cannot_read(
    make, name, first, tool, prepared_data, tmp_path, capsys
):
    """A truncated or mislabelled compressed file, a damaged Parquet file: one line naming
    the file and what is wrong, exit 2, nothing written, not even the output's new folder
    (a truncated .gz was an EOFError traceback, exit 1)."""
    data = copy_data(prepared_data, tmp_path)
    source = make(data, name)
    main, argv = tool(data, source)
    watch = Watch(tmp_path)
    outcome = data_tool(main, argv, capsys)
    check(outcome, EXIT_REFUSED, first.replace("{path}", str(source)))
    watch.assert_unchanged()
    watch.assert_no_process_left()


# -- damaged checkpoints at resume ---------------------------------------------------------


def _newest(run_dir: Path) -> Path:
    return checkpoint_files.iterations(run_dir / "checkpoints")[-1]


def _flip_byte(folder: Path, name: str = "model/common.pt") -> None:
    path = folder / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate_file(folder: Path, name: str = "trainer/rank0.pt") -> None:
    _truncate(folder / name, 100)


OPTIMIZER = "engine/pp0/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _flip_every_optimizer(run_dir: Path) -> None:
    """Every checkpoint fails to verify; their weights still do."""
    for folder in checkpoint_files.iterations(run_dir / "checkpoints"):
        _flip_byte(folder, OPTIMIZER)


# (damage, exit code, first line, also said): the launcher's pre-flight verifies by hash
# as the job's resume does; a dry run says what the job would do and queues nothing.
RESUME_CASES = {
    "flipped byte in the newest": (
        lambda run: _flip_byte(_newest(run)),
        0,
        "note: skipping checkpoint:",
        "contents do not match the manifest's",
    ),
    "truncated file in the newest": (
        lambda run: _truncate_file(_newest(run)),
        0,
        "note: skipping checkpoint:",
        "(truncated?)",
    ),
    "missing manifest in the newest": (
        lambda run: (_newest(run) / checkpoint_files.MANIFEST).unlink(),
        0,
        "note: skipping checkpoint:",
        "so the checkpoint was never completed",
    ),
    "flipped byte in every checkpoint": (
        _flip_every_optimizer,
        EXIT_REFUSED,
        "none of the 2 checkpoint(s)",
        "--resume weights:{run}/checkpoints/iter_0000004",
    ),
}


@pytest.mark.parametrize(
    ("damage", "code", "first", "said"), list(RESUME_CASES.values()), ids=list(RESUME_CASES)
)
def test_a_damaged_checkpoint_is_skipped_or_refused_at_resume(
    damage, code, first, said, prepared_run, tmp_path, capsys, monkeypatch
):
    run_dir = copy_run(prepared_run, tmp_path)
    damage(run_dir)
    watch = Watch(tmp_path)
    argv = ["--config", CONFIG, f"log.root={run_dir.parent}", f"name={RUN}", *SETTINGS]
    outcome = launcher([*argv, *(["--dry-run"] if code == 0 else [])], capsys, monkeypatch)
    check(outcome, code, first, said.replace("{run}", str(run_dir)))
    if code == 0:
        assert "resuming from iter_0000002 (the newest that verifies" in outcome.err
    watch.assert_unchanged()
    watch.assert_no_process_left()


def test_a_deleted_latest_changes_nothing_at_resume(prepared_run, tmp_path, capsys, monkeypatch):
    """``latest`` is a pointer for readers; the resume verifies the folders themselves."""
    run_dir = copy_run(prepared_run, tmp_path)
    (run_dir / "checkpoints" / checkpoint_files.LATEST).unlink()
    watch = Watch(tmp_path)
    argv = ["--config", CONFIG, f"log.root={run_dir.parent}", f"name={RUN}", *SETTINGS, "--dry-run"]
    outcome = launcher(argv, capsys, monkeypatch)
    assert outcome.code == 0 and "skipping" not in outcome.err, outcome.err
    assert f"==> run {RUN}" in outcome.out
    choice = checkpoint_files.choose_resume(run_dir / "checkpoints", "auto")
    assert choice.folder == run_dir / "checkpoints" / "iter_0000004" and not choice.refused
    watch.assert_unchanged()
    watch.assert_no_process_left()


def test_a_checkpoint_of_another_shape_is_refused_at_resume(
    prepared_run, tmp_path, capsys, monkeypatch
):
    run_dir = copy_run(prepared_run, tmp_path)
    watch = Watch(tmp_path)
    argv = ["--config", CONFIG, f"log.root={run_dir.parent}", f"name={RUN}", *SETTINGS]
    for entry in (cqk_train, launcher):
        outcome = entry([*argv, "model.hidden_size=128"], capsys, monkeypatch)
        check(
            outcome,
            EXIT_REFUSED,
            f"run folder {run_dir} holds a run of another shape",
            "model.hidden_size=64 (this config: 128)",
        )
    watch.assert_unchanged()
    watch.assert_no_process_left()


@pytest.mark.parametrize(
    ("resume", "first"),
    [
        ("weights:", "--resume 'weights:' names no checkpoint; give its folder"),
        ("weights:{tmp}/nowhere", "--resume weights:{tmp}/nowhere: {tmp}/nowhere is not a"),
        ("{tmp}/nowhere", "--resume {tmp}/nowhere: {tmp}/nowhere is not a checkpoint folder"),
    ],
    ids=["weights: empty", "weights: missing", "missing folder"],
)
def test_a_resume_path_that_is_no_checkpoint_is_refused(
    resume, first, prepared_run, tmp_path, capsys, monkeypatch
):
    run_dir = copy_run(prepared_run, tmp_path)
    watch = Watch(tmp_path)
    resume, first = (s.replace("{tmp}", str(tmp_path)) for s in (resume, first))
    argv = ["--config", CONFIG, f"log.root={run_dir.parent}", f"name={RUN}", *SETTINGS]
    outcome = cqk_train([*argv, "--resume", resume], capsys, monkeypatch)
    check(outcome, EXIT_REFUSED, first)
    watch.assert_unchanged()
    watch.assert_no_process_left()


# -- export --------------------------------------------------------------------------------


def _export(source: Path, out: Path, *extra: str) -> list[str]:
    return ["export", str(source), str(out), "--no-tokenizer", *extra]


# (source, output, first line): relative to the case's folder, the run at runs/base
OVERWRITE_CASES = {
    "into the run folder": ("runs/base", "runs/base"),
    "into a checkpoint": ("runs/base", "runs/base/checkpoints/iter_0000002"),
    "into the checkpoints folder": ("runs/base", "runs/base/checkpoints"),
    "into a parent of the run": ("runs/base", "runs"),
    "into its own input": (
        "runs/base/checkpoints/iter_0000004",
        "runs/base/checkpoints/iter_0000004",
    ),
}


@pytest.mark.parametrize(
    ("source", "target"), list(OVERWRITE_CASES.values()), ids=list(OVERWRITE_CASES)
)
def test_export_overwrite_never_deletes_a_run(source, target, prepared_run, tmp_path, capsys):
    copy_run(prepared_run, tmp_path)
    watch = Watch(tmp_path)
    outcome = convert(_export(tmp_path / source, tmp_path / target, "--overwrite"), capsys)
    check(outcome, EXIT_REFUSED, "cqk convert export: error: --force would delete")
    watch.assert_unchanged()
    watch.assert_no_process_left()


def _dataset_folder(case: Path, prepared_data: Path) -> Path:
    """A preprocessed corpus and its tokenizer, as ``cqk-preprocess`` leaves them."""
    folder = case / "corpus"
    folder.mkdir()
    for name in ("docs_text_document.bin", "docs_text_document.idx", "spm.model"):
        shutil.copy(prepared_data / name, folder / name)
    shutil.copy(prepared_data / "docs_text_document.meta.json", folder)
    return folder


def _tokenizer_folder(case: Path, prepared_data: Path) -> Path:
    folder = case / "tokenizer"
    folder.mkdir()
    shutil.copy(prepared_data / "spm.model", folder)
    return folder


def _unknown_files(case: Path, prepared_data: Path) -> Path:
    folder = case / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("mine\n")
    (folder / "plots").mkdir()
    (folder / "plots" / "loss.csv").write_text("1,2\n")
    return folder


def _export_with_a_file_added(case: Path, prepared_data: Path) -> Path:
    """An earlier export, then a file of the user's put beside its files."""
    folder = case / "hf"
    outcome = convert(_export(case / "runs" / RUN, folder), _Quiet())
    assert outcome.code == 0, outcome.err
    (folder / "eval_results.json").write_text("{}\n")
    return folder


class _Quiet:
    """A stand-in for ``capsys`` where a case prepares its folder with a command."""

    def readouterr(self):
        return argparse.Namespace(out="", err="")


# (what is at the output, first line): --force onto what no export wrote
FOREIGN_TARGETS = {
    "a dataset": (
        _dataset_folder,
        "which holds 4 file(s) that no earlier cqk convert export wrote: a dataset "
        "(docs_text_document.bin, docs_text_document.idx, docs_text_document.meta.json); "
        "a tokenizer (spm.model)",
    ),
    "a tokenizer": (
        _tokenizer_folder,
        "which holds 1 file(s) that no earlier cqk convert export wrote: a tokenizer (spm.model)",
    ),
    "unknown files": (
        _unknown_files,
        "which holds 2 file(s) that no earlier cqk convert export wrote: other files "
        "(plots/loss.csv, todo.txt)",
    ),
    "an export with a file added": (
        _export_with_a_file_added,
        "which holds 1 file(s) that the earlier cqk convert export there wrote",
    ),
}


@pytest.mark.parametrize("command", ["export", "import"])
@pytest.mark.parametrize(
    ("make", "first"), list(FOREIGN_TARGETS.values()), ids=list(FOREIGN_TARGETS)
)
def test_force_never_deletes_what_the_command_did_not_write(
    make, first, command, prepared_run, prepared_data, tmp_path, capsys
):
    """``--force`` onto a dataset, a tokenizer or unknown files: refused naming them, exit
    2, nothing deleted (an export deleted a corpus and its tokenizer, exit 0)."""
    run_dir = copy_run(prepared_run, tmp_path)
    target = make(tmp_path, prepared_data)
    source = run_dir
    if command == "import":
        source = tmp_path / "hf-source"
        assert convert(_export(run_dir, source), capsys).code == 0
    watch = Watch(tmp_path)
    argv = [command, str(source), str(target), "--force"]
    argv += ["--no-tokenizer"] if command == "export" else []
    outcome = convert(argv, capsys)
    said = f"cqk convert {command}: error: --force would delete '{target}', "
    # what an import may replace is its own weights-only checkpoint: to it, every one of
    # these folders is foreign; an export names what it found in full
    said += first if command == "export" else "which holds "
    check(outcome, EXIT_REFUSED, said, "nothing was deleted")
    watch.assert_unchanged()
    watch.assert_no_process_left()


def _foreign_dataset(case: Path, prepared_data: Path) -> tuple[Callable, list[str], str]:
    """A dataset that cqk data preprocess did not write (Megatron-LM's own tool writes no
    ``.meta.json``), at the prefix a preprocess with ``--force`` is given."""
    from data_tools import preprocess

    folder = case / "corpus"
    folder.mkdir()
    for name in ("docs_text_document.bin", "docs_text_document.idx"):
        shutil.copy(prepared_data / name, folder / name)
    argv = ["--input", str(prepared_data / "docs.jsonl"), "--tokenizer"]
    argv += [str(prepared_data / "spm.model"), "--out", str(folder / "docs_text_document")]
    first = (
        "error: --force would replace docs_text_document.bin, docs_text_document.idx in "
        f"'{folder}', which cqk data preprocess did not write (no docs_text_document.meta.json"
    )
    return preprocess.main, [*argv, "--workers", "1", "--quiet", "--force"], first


def _foreign_tokenizer(case: Path, prepared_data: Path) -> tuple[Callable, list[str], str]:
    """A tokenizer that cqk data tokenizer did not write (no ``.recipe.json``), at the
    prefix a tokenizer training with ``--force`` is given."""
    from data_tools import tokenizer

    folder = case / "tokenizer"
    folder.mkdir()
    shutil.copy(prepared_data / "spm.model", folder / "spm.model")
    argv = ["--input", str(prepared_data / "docs.jsonl"), "--out", str(folder / "spm")]
    first = (
        f"error: --force would replace spm.model in '{folder}', which cqk data tokenizer did "
        "not write (no spm.recipe.json"
    )
    return tokenizer.main, [*argv, "--vocab-size", "300", "--force"], first


@pytest.mark.parametrize(
    "make", [_foreign_dataset, _foreign_tokenizer], ids=["dataset", "tokenizer"]
)
def test_force_on_a_data_tool_never_replaces_what_it_did_not_write(
    make, prepared_data, tmp_path, capsys
):
    """``cqk data preprocess --force`` onto a dataset made elsewhere, ``cqk data tokenizer
    --force`` onto a tokenizer made elsewhere: refused naming them, exit 2, nothing replaced
    (both were replaced, exit 0). What the same command wrote there before, by its
    ``.meta.json`` or ``.recipe.json``, ``--force`` still replaces
    (``tests/test_data_tools.py``)."""
    main, argv, first = make(tmp_path, prepared_data)
    watch = Watch(tmp_path)
    outcome = data_tool(main, argv, capsys)
    check(outcome, EXIT_REFUSED, first, "nothing was deleted")
    watch.assert_unchanged()
    watch.assert_no_process_left()


def test_force_on_a_data_tool_replaces_its_own_earlier_output(prepared_data, tmp_path, capsys):
    from data_tools import tokenizer

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("spm.model", "spm.vocab", "spm.recipe.json"):
        shutil.copy(prepared_data / name, folder / name)
    argv = ["--input", str(prepared_data / "docs.jsonl"), "--out", str(folder / "spm")]
    outcome = data_tool(tokenizer.main, [*argv, "--vocab-size", "300", "--force"], capsys)
    assert outcome.code == 0, outcome.err
    assert json.loads((folder / "spm.recipe.json").read_text())["recipe"]["vocab_size"] == 300


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_the_demo_corpus_never_replaces_a_corpus_it_did_not_write(force, tmp_path, capsys):
    """``cqk data demo-corpus --out DIR`` where DIR holds the user's own corpus.jsonl (no
    manifest of the demo's): refused naming it, exit 2, nothing replaced (the corpus was
    replaced by the demo's, exit 0)."""
    from data_tools import demo_corpus

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "corpus.jsonl").write_text('{"text": "my own corpus"}\n')
    watch = Watch(tmp_path)
    outcome = data_tool(demo_corpus.main, ["--out", str(folder), "--quiet", *force], capsys)
    first = f"error: '{folder}' holds corpus.jsonl, which cqk data demo-corpus did not write"
    check(outcome, EXIT_REFUSED, first, "nothing was replaced")
    watch.assert_unchanged()
    watch.assert_no_process_left()


def _another_shape(run_dir: Path) -> None:
    """The newest checkpoint without a config of its own (as an older save wrote it),
    complete by its manifest, and its run's config changed to another hidden size since:
    the export reads the checkpoint with that config."""
    folder = _newest(run_dir)
    (folder / "config.yaml").unlink()
    checkpoint_files.write_manifest(folder, 4, with_hashes=True)
    path = run_dir / "config.yaml"
    path.write_text(path.read_text().replace("hidden_size: 64", "hidden_size: 128"))


# (damage, source, exit code, first line): a run folder export takes the newest checkpoint
# whose weights verify, and says which when a newer one does not
EXPORT_CASES = {
    "flipped byte in the newest": (
        lambda run: _flip_byte(_newest(run)),
        "runs/base",
        0,
        "note: exporting iter_0000002",
    ),
    "truncated weights in the newest": (
        lambda run: _truncate_file(_newest(run), "model/common.pt"),
        "runs/base",
        0,
        "note: exporting iter_0000002",
    ),
    "deleted latest": (
        lambda run: (run / "checkpoints" / checkpoint_files.LATEST).unlink(),
        "runs/base",
        0,
        "",
    ),
    "missing manifest": (
        lambda run: (_newest(run) / checkpoint_files.MANIFEST).unlink(),
        "runs/base/checkpoints/iter_0000004",
        EXIT_REFUSED,
        "is half-written",
    ),
    "another shape": (
        _another_shape,
        "runs/base/checkpoints/iter_0000004",
        EXIT_REFUSED,
        "cqk convert export: error: checkpoint {run}/checkpoints/iter_0000004 does not fit",
    ),
}


@pytest.mark.parametrize(
    ("damage", "source", "code", "first"), list(EXPORT_CASES.values()), ids=list(EXPORT_CASES)
)
def test_a_damaged_checkpoint_at_export(
    damage, source, code, first, prepared_run, tmp_path, capsys
):
    run_dir = copy_run(prepared_run, tmp_path)
    damage(run_dir)
    watch = Watch(tmp_path)
    out = tmp_path / "hf"
    outcome = convert(_export(tmp_path / source, out), capsys)
    check(outcome, code, first.replace("{run}", str(run_dir)))
    if not first:  # nothing to say: the newest checkpoint verifies
        assert "note:" not in outcome.err, outcome.err
    if code == 0:
        assert outcome.out.strip() == f"wrote {out}"
        assert (out / "config.json").is_file()
        watch.assert_unchanged(lambda change: change.startswith("added hf"))
    else:
        assert not out.exists()
        watch.assert_unchanged()
    watch.assert_no_process_left()


def _ctrl_c_as_on_a_terminal() -> None:  # in the child, before it starts
    # A process started in the background of a non-interactive shell (a CI script's
    # `... &`, nohup) inherits SIGINT ignored, and cqk keeps an ignored SIGINT ignored, as a
    # background job's: Ctrl-C then does nothing. A terminal's foreground job has the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _train_process(
    run_dir: Path, *overrides: str, log: Path, env: dict | None = None
) -> subprocess.Popen:
    """A real ``cqk-train`` of the run in ``run_dir``, its output to ``log``."""
    with log.open("w") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cqk_megatron.train",
                "--config",
                CONFIG,
                *replaced([f"log.root={run_dir.parent}", f"name={RUN}", *SETTINGS], *overrides),
            ],
            cwd=REPO,
            env={**ENV, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_ctrl_c_as_on_a_terminal,
        )


def _ended(process: subprocess.Popen) -> int:
    try:
        return process.wait(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_real_resume_skips_a_damaged_checkpoint_and_deletes_nothing(prepared_run, tmp_path):
    """``cqk-train``'s rank 0 verifies by hash as the launcher does: the flipped newest is
    skipped, moved whole to ``superseded/``, and the run goes on from the one before."""
    run_dir = copy_run(prepared_run, tmp_path)
    damaged = _newest(run_dir)
    _flip_byte(damaged)
    watch = Watch(tmp_path)
    log = tmp_path / "train.log"
    code = _ended(_train_process(run_dir, "train.resilience.exit_after_steps=3", log=log))
    text = log.read_text()
    assert code == EXIT_REQUEUE, text[-3000:]
    first = next(x for x in text.splitlines() if "skipping checkpoint" in x)
    assert f"{damaged}/model/common.pt: contents do not match the manifest's" in first, text
    assert f"resumed from {run_dir / 'checkpoints' / 'iter_0000002'} at step 2" in text, text
    # the damaged folder moved whole, byte for byte; nothing else written before changed
    (moved,) = (run_dir / "superseded").iterdir()
    old = "runs/base/checkpoints/iter_0000004"
    new = str((moved / "checkpoints" / "iter_0000004").relative_to(tmp_path))
    after = snapshot(tmp_path)
    for name, digest in watch.before.items():
        if name.startswith(old):
            assert after.get(new + name[len(old) :]) == digest, name
    rewritten = {"changed runs/base/metrics.jsonl", "changed runs/base/checkpoints/latest"}
    rewritten.add("changed runs/base/config.yaml")  # this attempt's exit_after_steps
    rewritten.add("changed runs/base/history.jsonl")  # ... and its record there
    watch.assert_unchanged(
        lambda change: (
            change in rewritten
            or change.startswith((f"removed {old}", "added runs/base/superseded"))
            or change.startswith(("added runs/base/checkpoints/iter_0000003", "added train.log"))
        )
    )
    # metrics.jsonl: the records up to the step resumed from kept as they were; those past
    # it are superseded by this attempt's (read_metrics' rule), which logged step 3 again
    kept = (prepared_run / "metrics.jsonl").read_text().splitlines(keepends=True)[:2]
    assert (run_dir / "metrics.jsonl").read_text().startswith("".join(kept))
    assert _steps(run_dir) == [1, 2, 3]
    watch.assert_no_process_left()


# -- signals -------------------------------------------------------------------------------


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return [r["step"] for r in records if r.get("kind") == "train"]


def test_sigterm_stops_training_with_75_and_a_checkpoint_it_resumes_from(prepared_run, tmp_path):
    """A real process: it resumes the prepared run, is signalled mid-run, saves, exits 75;
    what it had written before is untouched and its new checkpoint is the resume's choice."""
    run_dir = copy_run(prepared_run, tmp_path)
    watch = Watch(tmp_path)
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    log = tmp_path / "train.log"
    process = _train_process(
        run_dir,
        "train.train_steps=100000",
        "train.checkpoint.save_interval=100000",
        "train.resilience.exit_after_steps=null",
        log=log,
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(_steps(run_dir)) < 6 and process.poll() is None:  # resumed: 5, 6, ...
            assert time.monotonic() < deadline, "gave up waiting for the resumed steps"
            time.sleep(0.2)
    except BaseException:
        process.kill()
        process.wait()
        raise
    process.send_signal(signal.SIGTERM)
    code = _ended(process)
    text = log.read_text()
    assert code == EXIT_REQUEUE, text[-3000:]
    stop = next(line for line in text.splitlines() if line.startswith("stopping at step"))
    assert "(SIGTERM); checkpoint saved, exit 75 to requeue" in stop, stop
    step = int(stop.split()[3])
    steps = _steps(run_dir)
    assert steps == [1, 2, 3, 4, *range(5, step + 1)]  # each step once, none lost
    # written before: untouched (metrics.jsonl only appended to; latest and config.yaml
    # name the new checkpoint and the new train_steps); the new checkpoint is complete
    assert (run_dir / "metrics.jsonl").read_bytes().startswith(metrics_before)
    rewritten = {
        "changed runs/base/metrics.jsonl",
        "changed runs/base/config.yaml",
        "changed runs/base/history.jsonl",  # the attempt that trained, recorded
    }
    rewritten.add("changed runs/base/checkpoints/latest")
    rewritten.add("changed runs/base/history.jsonl")  # this attempt's settings and start
    new = f"added runs/base/checkpoints/iter_{step:07d}"
    watch.assert_unchanged(
        lambda change: change in rewritten or change.startswith(new) or change == "added train.log"
    )
    choice = checkpoint_files.choose_resume(run_dir / "checkpoints", "auto", hashes=True)
    assert choice.folder.name == f"iter_{step:07d}" and not choice.refused
    assert checkpoint_files.latest_name(run_dir / "checkpoints") == choice.folder.name
    assert not (run_dir / "lease.json").exists()
    watch.assert_no_process_left()


def _signal_when_resumed(process: subprocess.Popen, run_dir: Path, signum: int) -> None:
    """Wait until the resumed run has trained past its checkpoint, then signal it."""
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(_steps(run_dir)) < 6 and process.poll() is None:  # resumed: 5, 6, ...
            assert time.monotonic() < deadline, "gave up waiting for the resumed steps"
            time.sleep(0.2)
    except BaseException:
        process.kill()
        process.wait()
        raise
    process.send_signal(signum)


NO_SAVES = (
    "train.train_steps=100000",
    "train.checkpoint.save_interval=100000",
    "train.resilience.exit_after_steps=null",
)


def test_ctrl_c_stops_training_with_75_and_a_checkpoint_it_resumes_from(prepared_run, tmp_path):
    """SIGINT as SIGTERM: a save, one line, exit 75 (it was a KeyboardInterrupt traceback,
    exit -2, nothing saved)."""
    run_dir = copy_run(prepared_run, tmp_path)
    watch = Watch(tmp_path)
    log = tmp_path / "train.log"
    process = _train_process(run_dir, *NO_SAVES, log=log)
    _signal_when_resumed(process, run_dir, signal.SIGINT)
    code = _ended(process)
    text = log.read_text()
    assert code == EXIT_REQUEUE, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    stop = next(line for line in text.splitlines() if line.startswith("stopping at step"))
    assert "(SIGINT); checkpoint saved, exit 75 to requeue" in stop, stop
    step = int(stop.split()[3])
    assert _steps(run_dir) == [1, 2, 3, 4, *range(5, step + 1)]
    rewritten = {
        "changed runs/base/metrics.jsonl",
        "changed runs/base/config.yaml",
        "changed runs/base/history.jsonl",  # the attempt that trained, recorded
    }
    rewritten.add("changed runs/base/checkpoints/latest")
    new = f"added runs/base/checkpoints/iter_{step:07d}"
    watch.assert_unchanged(
        lambda change: change in rewritten or change.startswith(new) or change == "added train.log"
    )
    assert checkpoint_files.latest_name(run_dir / "checkpoints") == f"iter_{step:07d}"
    watch.assert_no_process_left()


def test_a_second_ctrl_c_during_the_save_stops_at_once_keeping_the_previous_checkpoint(
    prepared_run, tmp_path
):
    """The first Ctrl-C asks for a save, which hangs (a fault drill at the save's start, a
    slow filesystem's stand-in); the second stops the process at once: exit 130, one line
    naming the checkpoint that stays newest, no traceback, nothing half-written left."""
    run_dir = copy_run(prepared_run, tmp_path)
    watch = Watch(tmp_path)
    log = tmp_path / "train.log"
    hang = {"CQK_FAULT": "rank=0,phase=save,action=hang"}
    process = _train_process(run_dir, *NO_SAVES, log=log, env=hang)
    _signal_when_resumed(process, run_dir, signal.SIGINT)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while "CQK_FAULT: hang at" not in log.read_text() and process.poll() is None:
            assert time.monotonic() < deadline, "gave up waiting for the save"
            time.sleep(0.1)
    except BaseException:
        process.kill()
        process.wait()
        raise
    process.send_signal(signal.SIGINT)
    code = _ended(process)
    text = log.read_text()
    assert code == 130, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    (said,) = [line for line in text.splitlines() if line.startswith("interrupted")]
    newest = run_dir / "checkpoints" / "iter_0000004"
    assert said == (
        f"interrupted: stopped at once, without saving; the newest complete checkpoint is "
        f"still {newest}"
    ), said
    # only the steps' records were added; the checkpoints are as they were
    watch.assert_unchanged(
        lambda change: (
            change
            in {
                "changed runs/base/metrics.jsonl",
                "changed runs/base/config.yaml",
                "changed runs/base/history.jsonl",  # the attempt that trained, recorded
            }
            or change == "added train.log"
        )
    )
    assert not (run_dir / "lease.json").exists()
    watch.assert_no_process_left()


STOP_NOW_BOUND_S = 90  # the launcher's wait after a second Ctrl-C, with slack


def _wait_for(ready: Callable[[], bool], process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not ready():
        assert process.poll() is None, f"ended ({process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def _job_logs(run_dir: Path) -> str:
    logs = sorted((run_dir / "submitit").glob("*_log.*"))
    return "\n".join(path.read_text(errors="replace") for path in logs)


def _kill_tree(process: subprocess.Popen) -> None:
    """A process that outlived its test, with its children (ranks start sessions of
    their own)."""
    if process.poll() is not None:
        return
    for child in psutil.Process(process.pid).children(recursive=True):
        child.kill()
    process.kill()
    process.wait()


def _gone(watch: Watch, bound_s: float) -> None:
    """Every process under the watched folder has ended within ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while processes_left(watch.children, str(watch.folder)) and time.monotonic() < deadline:
        time.sleep(0.2)
    watch.assert_no_process_left()


def test_a_second_ctrl_c_to_the_launcher_stops_its_local_job_at_once(prepared_run, tmp_path):
    """``cqk submit --cluster local``: the first Ctrl-C cancels the job, whose rank starts
    its save (which hangs: a fault drill, a slow filesystem's stand-in); the second stops
    the job at once (its rank used to finish the save first): exit 130, one line, no
    traceback, every process gone within a bound, the previous complete checkpoint still
    the newest and nothing half-written taken for one."""
    run_dir = copy_run(prepared_run, tmp_path)
    checkpoints = run_dir / "checkpoints"
    before = sorted(path.name for path in checkpoints.iterdir())
    watch = Watch(tmp_path)
    settings = replaced([f"log.root={run_dir.parent}", f"name={RUN}", *SETTINGS], *NO_SAVES)
    command = [sys.executable, "-m", "cqk_megatron", "submit", "--profile", PROFILE]
    command += ["--cluster", "local", "--tasks", "1", "--config", CONFIG, *settings]
    log = tmp_path / "submit.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env={**ENV, "CQK_FAULT": "rank=0,phase=save,action=hang"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: the terminal's foreground group
            preexec_fn=_ctrl_c_as_on_a_terminal,
        )
    try:
        _wait_for(lambda: len(_steps(run_dir)) >= 6, process, "the resumed steps")
        os.killpg(process.pid, signal.SIGINT)
        _wait_for(lambda: "CQK_FAULT: hang at" in _job_logs(run_dir), process, "the save")
        os.killpg(process.pid, signal.SIGINT)
        code = process.wait(timeout=STOP_NOW_BOUND_S)
    finally:
        _kill_tree(process)
    text = log.read_text()
    assert code == 130, text[-3000:]
    _gone(watch, 15)
    assert "Traceback" not in text, text[-3000:]
    (said,) = [line for line in text.splitlines() if line.startswith("interrupted again")]
    assert said == (
        "interrupted again: stopping the local jobs at once, without their saves (each run "
        "resumes from its newest complete checkpoint)"
    ), said
    assert "interrupted: stopped at once, without saving" in _job_logs(run_dir)
    assert sorted(path.name for path in checkpoints.iterdir()) == before
    assert checkpoint_files.latest_name(checkpoints) == "iter_0000004"
    choice = checkpoint_files.choose_resume(checkpoints, "auto", hashes=True)
    assert choice.folder.name == "iter_0000004" and not choice.refused


def test_a_second_ctrl_c_to_cqk_torchrun_stops_its_ranks_at_once(prepared_run, tmp_path):
    """``cqk torchrun`` with 2 ranks, Ctrl-C'd twice (SIGINT to its group, as a terminal
    sends it): the first asks for a save, which hangs on rank 0 (a fault drill); the
    second stops both ranks at once (torchrun's agent sends them SIGINT, then SIGTERM):
    exit 130, one line, no traceback, the previous complete checkpoint still the newest."""
    from _multiproc import free_port

    run_dir = copy_run(prepared_run, tmp_path)
    checkpoints = run_dir / "checkpoints"
    before = sorted(path.name for path in checkpoints.iterdir())
    watch = Watch(tmp_path)
    settings = replaced([f"log.root={run_dir.parent}", f"name={RUN}", *SETTINGS], *NO_SAVES)
    command = [sys.executable, "-m", "cqk_megatron", "torchrun", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), "-m", "cqk_megatron.train"]
    log = tmp_path / "torchrun.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [*command, "--config", CONFIG, *settings],
            cwd=REPO,
            env={**ENV, "CQK_FAULT": "rank=0,phase=save,action=hang"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: the terminal's foreground group
            preexec_fn=_ctrl_c_as_on_a_terminal,
        )
    try:
        _wait_for(lambda: len(_steps(run_dir)) >= 6, process, "the resumed steps")
        os.killpg(process.pid, signal.SIGINT)
        _wait_for(lambda: "CQK_FAULT: hang at" in log.read_text(), process, "the save")
        os.killpg(process.pid, signal.SIGINT)
        code = process.wait(timeout=STOP_NOW_BOUND_S)
    finally:
        _kill_tree(process)
    text = log.read_text()
    assert code == 130, text[-3000:]
    _gone(watch, 15)
    assert "Traceback" not in text, text[-3000:]
    (said,) = [line for line in text.splitlines() if line.startswith("interrupted")]
    newest = checkpoints / "iter_0000004"
    assert said == (
        f"interrupted: stopped at once, without saving; the newest complete checkpoint is "
        f"still {newest}"
    ), said
    assert sorted(path.name for path in checkpoints.iterdir()) == before
    assert checkpoint_files.latest_name(checkpoints) == "iter_0000004"


LONG = "x" * 300  # a path component over the 255 bytes a filesystem allows


@pytest.mark.parametrize(
    "overrides",
    [
        (f"log.root={{tmp}}/{LONG}",),
        ("data.mock=false", f"data.prefixes=[{{tmp}}/{LONG}]", "data.tokenizer={tmp}/t.model"),
        (f"data.tokenizer={{tmp}}/{LONG}.model",),
    ],
    ids=["log.root", "data.prefixes", "data.tokenizer"],
)
def test_a_name_too_long_is_refused_in_one_line(
    overrides, prepared_data, tmp_path, capsys, monkeypatch
):
    """An uncaught ``OSError [Errno 36]`` traceback, exit 1, before."""
    data = copy_data(prepared_data, tmp_path)
    watch = Watch(tmp_path)
    settings = [f"log.root={tmp_path / 'runs'}", *data_overrides(data)]
    changes = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    outcome = cqk_train(["--config", CONFIG, *replaced(settings, *changes)], capsys, monkeypatch)
    check(outcome, EXIT_REFUSED, f"error: file name too long: {tmp_path}/", "shorten the name")
    watch.assert_unchanged()
    watch.assert_no_process_left()


def test_ctrl_c_on_cqk_torchrun_saves_and_exits_75(tmp_path):
    """Ctrl-C at a terminal: SIGINT to the foreground process group, which holds
    ``cqk torchrun``'s agent (it passes SIGINT on to its worker). The worker saves and
    stops with 75, and so does ``cqk torchrun`` (a KeyboardInterrupt traceback before)."""
    from _multiproc import free_port

    command = [sys.executable, "-m", "cqk_megatron", "torchrun", "--nproc-per-node", "1"]
    command += ["--master-port", str(free_port()), "-m", "cqk_megatron.train"]
    command += ["--config", CONFIG, f"log.root={tmp_path}", "name=interrupted", *NO_SAVES]
    watch = Watch(tmp_path)
    log = tmp_path / "torchrun.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=ENV,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: the terminal's foreground group
            preexec_fn=_ctrl_c_as_on_a_terminal,
        )
    run_dir = tmp_path / "interrupted"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(_steps(run_dir)) < 3 and process.poll() is None:
            assert time.monotonic() < deadline, "gave up waiting for the steps"
            time.sleep(0.2)
        os.killpg(process.pid, signal.SIGINT)
    finally:
        code = _ended(process)
    text = log.read_text()
    assert code == EXIT_REQUEUE, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "(SIGINT); checkpoint saved, exit 75 to requeue" in text, text[-3000:]
    assert "cqk torchrun: exit 75 (workers: {0: 75})" in text, text[-3000:]
    step = _steps(run_dir)[-1]
    assert checkpoint_files.latest_name(run_dir / "checkpoints") == f"iter_{step:07d}"
    watch.assert_unchanged(
        lambda change: change.startswith("added interrupted") or change == "added torchrun.log"
    )
    watch.assert_no_process_left()
