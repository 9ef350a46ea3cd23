"""Bad input is refused with a clear message and nothing written before is lost (issue 27).

- ``--help`` and ``-h`` of every console script in ``setup.py`` and of every subcommand
  exit 0 with a usage (in-process, through each script's ``main``);
- a config with inf or nan in any float field, or a run name that is not one safe path
  segment, is refused (by ``cqk-train`` before it imports Megatron, and at submit);
- ``cqk convert export/import --force`` (old spelling ``--overwrite``) never deletes a run
  folder, a checkpoint, a folder holding or inside either, or its own input; an export of
  a run whose newest checkpoint is damaged takes the newest one that verifies;
- a run whose weights stop being finite saves no checkpoint of them: ``latest`` stays on
  the last good one.

The training runs are the tiny model of ``tests/_training.py`` on synthetic data, in one
spawned gloo rank.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import re
import shutil
from pathlib import Path

import pytest
from _multiproc import run_ranks
from _training import attempts, train_attempts

REPO = Path(__file__).resolve().parent.parent

# -- --help of every command -----------------------------------------------------------------

# Subcommands that a script dispatches to another module's main before its own argparse
# parser sees them (so the parser cannot list them).
DISPATCHED = {"cqk-submit": [["status"], ["cancel"]]}


def console_scripts() -> dict[str, str]:
    """``name: module:function`` of every console script that setup.py installs."""
    text = (REPO / "setup.py").read_text()
    scripts = dict(re.findall(r'"(cqk-[\w-]+)=([\w.]+:\w+)"', text))
    assert len(scripts) >= 15, scripts  # the pattern still reads setup.py
    return scripts


def _main_of(target: str):
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def _help_of(main, argv: list[str], monkeypatch) -> tuple[object, str, list]:
    """What ``main(argv)`` (which asks for help) exits with and prints, and the parsers
    whose help it printed."""
    printed: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.print_help

    def recording(self, file=None):
        printed.append(self)
        return original(self, file)

    monkeypatch.setattr(argparse.ArgumentParser, "print_help", recording)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)  # cqk-torchrun returns torchrun's outcome
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), printed


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    return [
        name
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
    ]


@pytest.mark.parametrize("script", sorted(console_scripts()))
def test_help_of_every_command_and_subcommand_exits_0_with_a_usage(script, monkeypatch):
    # cqk-torchrun names a folder for its workers' exit codes in the environment
    monkeypatch.setenv("CQK_EXIT_DIR", "")
    main = _main_of(console_scripts()[script])
    pending = [[], *DISPATCHED.get(script, [])]
    seen = []
    while pending:
        words = pending.pop(0)
        for flag in ("--help", "-h") if not words else ("--help",):
            code, text, parsers = _help_of(main, [*words, flag], monkeypatch)
            where = " ".join([script, *words, flag])
            assert code in (0, None), f"{where}: exit {code}\n{text}"
            assert "usage:" in text and len(text.strip()) > len("usage:"), f"{where}: {text!r}"
        seen.append(" ".join(words))
        if parsers:
            pending += [[*words, name] for name in _subcommands(parsers[-1])]
    assert seen  # at least the command itself


# -- config: finite numbers, run names, refusals before Megatron ----------------------------


def _float_fields(cls: type, prefix: str = "") -> list[tuple[str, object]]:
    """``(dotted name, annotation)`` of every float field of the typed schema (floats,
    optional floats, lists of floats)."""
    import dataclasses
    import typing

    found = []
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            found += _float_fields(hint, f"{prefix}{name}.")
        elif float in (hint, *typing.get_args(hint)) or "list[float]" in str(hint):
            found.append((f"{prefix}{name}", hint))
    return found


def test_the_schema_has_the_float_fields_this_test_expects():
    from cqk_megatron.config import RunConfig

    names = [name for name, _ in _float_fields(RunConfig)]
    assert {
        "train.optimizer.lr",
        "attention.dt_init",
        "data.weights",
        "train.resilience.wall_clock_budget_s",
    } <= set(names)
    assert len(names) >= 20, names


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_numbers_are_refused_in_every_float_field(value):
    from cqk_megatron.config import ConfigError, RunConfig, load_config, validate

    accepted = []
    for dotted, hint in _float_fields(RunConfig):
        given = f"[{value}]" if "list" in str(hint) else value
        try:
            validate(load_config(None, [f"{dotted}={given}", "data.prefixes=[p]"]))
        except ConfigError as error:
            shown = value.lstrip(".").replace("-.", "-")
            assert f"{dotted}" in str(error) and "is not a finite number" in str(error), error
            assert shown.lstrip("-") in str(error)
            continue
        accepted.append(dotted)
    assert accepted == []


# "{tmp}/x" is an absolute name inside the test's folder: were a name taken as a path (as
# before the check), every case writes there, and trains one step.
BAD_NAMES = ["../x", "../../escape2", "{tmp}/x", "a/b", "", "a\x07b", "a\nb", "..", ".", "-x"]
ONE_STEP = ["train.train_steps=1", "log.wandb_mode=disabled"]


def _name_override(name: str, tmp_path: Path) -> str:
    """``name=...`` as a YAML double-quoted scalar (control characters escaped)."""
    import json

    return "name=" + json.dumps(name.replace("{tmp}", str(tmp_path)))


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_a_run_name_that_is_not_one_safe_path_segment_is_refused_by_cqk_train(
    name, tmp_path, capsys
):
    from cqk_megatron.train import main

    root = tmp_path / "a" / "root"
    code = main(["data.mock=true", f"log.root={root}", *ONE_STEP, _name_override(name, tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: invalid config:") and "is not a run name" in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written, inside the root or beside it


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "submit"])
@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_a_run_name_that_is_not_one_safe_path_segment_is_refused_at_submit(
    name, dry_run, tmp_path, capsys
):
    from launch.submit import main

    root = tmp_path / "a" / "root"
    argv = ["--config", str(REPO / "configs/runs/tiny_cpu.yaml"), "--cluster", "local"]
    argv += ["--dry-run"] if dry_run else ONE_STEP
    code = main([*argv, f"log.root={root}", _name_override(name, tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "is not a run name" in err and out == "", out + err
    assert list(tmp_path.iterdir()) == []


def test_a_layout_refusal_comes_before_megatron_is_imported(tmp_path):
    """The world size's checks (here: one process for tensor parallel 2, and a batch that
    three ranks do not divide) refuse the run without importing torch or Megatron."""
    import os
    import subprocess
    import sys

    probe = (
        "import sys; from cqk_megatron.train import main; code = main(sys.argv[1:]); "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'megatron', 'deepspeed')); print('imported:', heavy[:3]); sys.exit(code)"
    )
    cases = [
        ({}, ["parallel.tensor_parallel=2"], "world size 1 is not divisible"),
        ({"RANK": "0", "WORLD_SIZE": "3"}, [], "train.global_batch_size=8 is not divisible"),
    ]
    for env, overrides, message in cases:
        given = ["data.mock=true", f"log.root={tmp_path}", *overrides]
        done = subprocess.run(
            [sys.executable, "-c", probe, *given],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **env, "PYTHONPATH": str(REPO)},
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("error: invalid config:") and message in done.stderr
        assert done.stdout.strip() == "imported: []", done.stdout + done.stderr


# -- runs to export, and a run that diverges -------------------------------------------------

QUIET = ["train.eval_interval=100", "train.checkpoint.hashes=true"]


DIVERGING = 2  # the attempts of train_then_diverge whose weights turn NaN


def train_then_diverge(rank, world_size, port, root, runs) -> None:
    """``train_attempts``, the last ``DIVERGING`` attempts with every optimizer step followed
    by a NaN in one weight: a stand-in for an update that overflows. (A config cannot do it here any
    more: lr=.inf is refused now, at lr=1e30 fp32 AdamW leaves the weights finite near
    1e30 and only the gradients overflow, and torch refuses an lr beyond fp32's range.)"""
    import torch

    from cqk_megatron.training.engines.deepspeed import DeepSpeedEngine

    train_attempts(rank, world_size, port, root, runs[:-DIVERGING])
    original = DeepSpeedEngine.train_step

    def diverging_step(self, micro_batches):
        result = original(self, micro_batches)
        with torch.no_grad():
            next(p for p in self.model.parameters() if p.dim() >= 2).view(-1)[0] = float("nan")
        return result

    DeepSpeedEngine.train_step = diverging_step
    train_attempts(rank, world_size, port, root, runs[-DIVERGING:])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """``export``: checkpoints at steps 2 and 4. ``diverged``: good checkpoints at steps 1
    and 2, then resumed with weights that are not finite after step 3 (a save every step)."""
    root = tmp_path_factory.mktemp("trained")
    every_step = [*QUIET, "train.checkpoint.save_interval=1"]
    runs = [
        ("export", [*QUIET, "train.train_steps=4", "train.checkpoint.save_interval=2"]),
        ("diverged", [*every_step, "train.train_steps=2"]),
        # the asynchronous save starts the same way: no staged copy of NaN weights either
        (
            "diverged-async",
            [*every_step, "train.train_steps=2", "train.checkpoint.async_save=true"],
        ),
        # the last DIVERGING attempts diverge
        ("diverged", [*every_step, "train.train_steps=6"]),
        (
            "diverged-async",
            [*every_step, "train.train_steps=6", "train.checkpoint.async_save=true"],
        ),
    ]
    run_ranks(train_then_diverge, 1, str(root), runs)
    return root


def _hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _convert(argv: list[str], capsys) -> tuple[int, str]:
    from cqk_megatron.cli.convert import main

    code = main(argv)
    out, err = capsys.readouterr()
    return code, out + err


@pytest.mark.parametrize("name", ["diverged", "diverged-async"])
def test_a_run_that_diverges_saves_no_checkpoint_of_non_finite_weights(trained, name):
    good, diverged = attempts(trained, name)
    assert good["exit"] == 0, good
    assert diverged.get("error") == "CheckpointSaveError", diverged
    message = diverged["message"]
    assert message.startswith("not saving iter_0000003: the weights at step 3 are not finite")
    assert "the previous checkpoint iter_0000002 stays latest" in message
    checkpoints = trained / name / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "iter_0000001",
        "iter_0000002",
        "latest",
    ]
    assert (checkpoints / "latest").read_text().strip() == "iter_0000002"
    before = {k: v for k, v in good["files"].items() if k.startswith("checkpoints/")}
    after = {k: v for k, v in diverged["files"].items() if k.startswith("checkpoints/")}
    assert after == before  # the good checkpoints as they were


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    """A copy of the ``export`` run, alone in its own root."""
    run = tmp_path / "root" / "export"
    shutil.copytree(trained / "export", run)
    return run


def test_overwrite_never_deletes_a_run_a_checkpoint_or_the_input(run_copy, capsys):
    run = run_copy
    root = run.parent
    checkpoint = run / "checkpoints" / "iter_0000002"
    code, said = _convert(["export", str(run), str(run / "hf"), "--no-tokenizer"], capsys)
    assert code == 0, said  # a new folder inside the run: nothing is replaced
    before = _hashes(root)
    cases = {
        "the run folder": ("export", run, run),
        "a checkpoint folder": ("export", run, checkpoint),
        "a parent of the run folder": ("export", run, root),
        "its own input": ("export", checkpoint, checkpoint),
        "a folder inside the run folder": ("export", run, run / "hf"),
        "import into a run's checkpoint": ("import", run / "hf", checkpoint),
        "import into the run folder": ("import", run / "hf", run),
        "import into its own input": ("import", run / "hf", run / "hf"),
    }
    for case, (command, source, target) in cases.items():
        flags = ["--no-tokenizer"] if command == "export" else []
        argv = [command, str(source), str(target), *flags, "--overwrite"]
        code, said = _convert(argv, capsys)
        assert code == 2, f"{case}: {said}"
        assert said.startswith(f"cqk convert {command}: error: --force would delete"), said
        assert "nothing was deleted" in said, f"{case}: {said}"
        assert _hashes(root) == before, case
        assert sorted(p.name for p in root.iterdir()) == ["export"], case  # no staging left


def test_overwrite_still_replaces_a_folder_the_tool_wrote(run_copy, tmp_path, capsys):
    hf, weights = tmp_path / "hf", tmp_path / "weights"
    for _ in range(2):  # the second time over the first's output
        code, said = _convert(
            ["export", str(run_copy), str(hf), "--no-tokenizer", "--overwrite"], capsys
        )
        assert code == 0, said
        code, said = _convert(["import", str(hf), str(weights), "--overwrite"], capsys)
        assert code == 0, said


def test_export_of_a_run_whose_newest_checkpoint_is_damaged_takes_the_newest_that_verifies(
    run_copy, tmp_path, capsys
):
    newest = run_copy / "checkpoints" / "iter_0000004" / "model"
    shard = max(
        (p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size
    )
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, another sha256
    shard.write_bytes(bytes(data))
    out = tmp_path / "hf"
    code, said = _convert(["export", str(run_copy), str(out), "--no-tokenizer"], capsys)
    assert code == 0, said
    assert "note: exporting iter_0000002, the newest checkpoint" in said
    assert "iter_0000004: " in said and "contents do not match the manifest's xxh3_128" in said
    assert "| Iteration | 2 |" in (out / "README.md").read_text()


# -- data: a foreign index without a meta file, text that is not text ---------------------


def _documents(count: int) -> list[str]:
    """Documents of different lengths, so that their ends move when the order changes."""
    import random

    rng = random.Random(0)
    words = "the model reads tokens and writes text over many quiet days".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) for _ in range(count)]


def _jsonl(path: Path, documents: list[str]) -> Path:
    import json

    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """A tokenizer, and the same documents preprocessed in order and in reverse order."""
    from data_tools import preprocess
    from data_tools import tokenizer as tokenizer_tool

    folder = tmp_path_factory.mktemp("corpus")
    documents = _documents(200)
    forward = _jsonl(folder / "forward.jsonl", documents)
    backward = _jsonl(folder / "backward.jsonl", documents[::-1])
    recipe = tokenizer_tool.TokenizerRecipe(
        vocab_size=60, byte_fallback=False, sample_documents=200, threads=1
    )
    model = tokenizer_tool.train_tokenizer([str(forward)], folder / "spm", recipe).model
    made = {"tokenizer": model, "folder": folder}
    for name, source in (("forward", forward), ("backward", backward)):
        made[name] = folder / name
        preprocess.preprocess([str(source)], made[name], model, workers=1, progress=False)
    return made


def _dataset_copy(corpus: dict[str, Path], folder: Path, idx_from: str = "forward") -> str:
    """The forward dataset's .bin beside the .idx of ``idx_from``, without a .meta.json."""
    folder.mkdir(parents=True, exist_ok=True)
    prefix = folder / "data"
    shutil.copyfile(f"{corpus['forward']}.bin", f"{prefix}.bin")
    shutil.copyfile(f"{corpus[idx_from]}.idx", f"{prefix}.idx")
    return str(prefix)


def _data_config(prefix: str, corpus: dict[str, Path], root: Path):
    from cqk_megatron.config import load_config

    return load_config(
        None,
        [
            f"data.prefixes=[{prefix}]",
            f"data.tokenizer={corpus['tokenizer']}",
            "model.vocab_size=128",
            "model.seq_length=16",
            "train.train_steps=2",
            "train.eval_interval=2",
            f"log.root={root}",
            "name=data",
        ],
    )


def test_a_same_size_index_of_another_order_without_a_meta_file_is_refused(
    corpus, tmp_path, capsys
):
    from cqk_megatron.data.checks import check_run_data
    from cqk_megatron.data.errors import DataError
    from cqk_megatron.train import main

    assert Path(f"{corpus['forward']}.idx").stat().st_size == (
        Path(f"{corpus['backward']}.idx").stat().st_size
    )
    own = _dataset_copy(corpus, tmp_path / "own")
    check_run_data(_data_config(own, corpus, tmp_path))  # its own index: accepted

    foreign = _dataset_copy(corpus, tmp_path / "foreign", idx_from="backward")
    assert not Path(f"{foreign}.meta.json").exists()
    config = _data_config(foreign, corpus, tmp_path)
    with pytest.raises(DataError, match=r"document \d+ \(of 200\) does not end with the EOD id"):
        check_run_data(config)
    code = main([f"data.prefixes=[{foreign}]", *_overrides_of(config)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: dataset '{foreign}': document "), err
    assert "does not belong to" in err and "(it has no data.meta.json)" in err
    assert not (tmp_path / "data").exists()  # refused before a run folder was made


def _overrides_of(config) -> list[str]:
    return [
        f"data.tokenizer={config.data.tokenizer}",
        f"model.vocab_size={config.model.vocab_size}",
        f"model.seq_length={config.model.seq_length}",
        f"train.train_steps={config.train.train_steps}",
        f"train.eval_interval={config.train.eval_interval}",
        f"log.root={config.log.root}",
        f"name={config.name}",
    ]


def test_an_index_whose_documents_overlap_is_refused(corpus, tmp_path):
    """Offsets are checked whether or not a meta file exists: here document 1 starts where
    document 0 does, and the sizes still add up to the .bin."""
    import numpy as np

    from cqk_megatron.data.checks import check_prefix, read_index
    from cqk_megatron.data.errors import DataError

    prefix = _dataset_copy(corpus, tmp_path)
    index = read_index(prefix)
    pointers_at = 34 + index.lengths.nbytes  # header (9 + 8 + 1 + 16 bytes), then lengths
    pointers = index.pointers.copy()
    pointers[1] = pointers[0]
    with open(f"{prefix}.idx", "r+b") as stream:
        stream.seek(pointers_at)
        stream.write(pointers.astype(np.int64).tobytes())
    assert read_index(prefix).pointers[1] == 0
    with pytest.raises(DataError, match="places document 1 .* not right after the document"):
        check_prefix(prefix)


def test_a_text_file_of_random_bytes_is_refused_naming_the_file_and_the_option(
    corpus, tmp_path, capsys
):
    import random

    from data_tools import preprocess
    from data_tools import tokenizer as tokenizer_tool

    noise = tmp_path / "noise.txt"
    noise.write_bytes(random.Random(0).randbytes(64 << 10))
    out = tmp_path / "out"
    common = ["--input", str(noise), "--output-prefix", str(out)]
    for main, argv in (
        (preprocess.main, [*common, "--tokenizer", str(corpus["tokenizer"]), "--quiet"]),
        (tokenizer_tool.main, [*common, "--vocab-size", "400"]),
    ):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.startswith(f"error: input '{noise}' is not text: "), err
        assert "are invalid UTF-8 sequences, more than --max-invalid-utf8 0.2 (20%)" in err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["noise.txt"]
    code = preprocess.main(
        [*common, "--tokenizer", str(corpus["tokenizer"]), "--quiet", "--max-invalid-utf8", "1"]
    )
    assert code == 0 and Path(f"{out}.bin").is_file()  # asked for: replaced and reported
    assert "replaced" in capsys.readouterr().err


@pytest.mark.parametrize("resume", ["weights:", "", "weights: "])
def test_a_resume_that_names_no_checkpoint_says_so(resume, tmp_path, capsys):
    from cqk_megatron.train import main

    code = main(["data.mock=true", f"log.root={tmp_path}", "name=r", "--resume", resume])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"error: --resume {resume!r} names no checkpoint; give its folder")
