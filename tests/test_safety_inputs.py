"""Bad input is refused with a clear message and nothing written before is lost (issue 27).

- ``--help`` and ``-h`` of every console script in ``setup.py`` and of every subcommand
  exit 0 with a usage (in-process, through each script's ``main``);
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

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
    assert {"train.lr", "attention.dt_init", "data.weights", "train.wall_clock_budget_s"} <= set(
        names
    )
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
