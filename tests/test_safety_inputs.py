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
