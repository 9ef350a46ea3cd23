"""Run one command's ``--help`` as its console script would, and report on its parser.

    python tests/_cli_probe.py PROGRAM module:function REPORT.json ARG...

``sys.argv[0]`` is ``PROGRAM`` (the name the parsers show), the function is called with
the ``ARG``s, and every parser that prints help is recorded (``print_help`` patched):
REPORT.json gets the exit code, the heavy modules imported, and per parser its actions
without help, the defaults its help does not show, and its subcommands. Nothing else is
written to stdout or stderr than what the command itself writes (test_cli_help.py checks
that stderr stays empty).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

HEAVY = ("torch", "megatron", "deepspeed", "transformers", "pandas", "matplotlib", "scipy")


def meaningful_default(action: argparse.Action) -> bool:
    """A default a reader needs to see: set, not suppressed, not an empty list, not the
    off state of an on/off flag."""
    default = action.default
    if default is None or default is argparse.SUPPRESS or default in ([], ()):
        return False
    if isinstance(default, bool) and action.nargs == 0:
        return False
    return action.help is not argparse.SUPPRESS


def is_alias(action: argparse.Action, parser: argparse.ArgumentParser) -> bool:
    """A hidden old spelling: help suppressed, and a shown action sets the same value."""
    return any(
        other is not action and other.dest == action.dest and other.help is not argparse.SUPPRESS
        for other in parser._actions
    )


def describe(parser: argparse.ArgumentParser) -> dict:
    formatter = parser._get_formatter()
    no_help, hidden_defaults, subcommands = [], [], []
    for action in parser._actions:
        name = "/".join(action.option_strings) or action.dest
        if isinstance(action, argparse._SubParsersAction):
            subcommands += list(action.choices)
            no_help += [f"{c.dest} (subcommand)" for c in action._choices_actions if not c.help]
        if action.help is argparse.SUPPRESS:
            if not is_alias(action, parser):
                no_help.append(f"{name} (suppressed, not an alias)")
            continue
        if not action.help:
            no_help.append(name)
            continue
        if meaningful_default(action):
            shown = formatter._expand_help(action)
            if "default" not in shown or str(action.default) not in shown:
                hidden_defaults.append(f"{name}={action.default!r}: {shown!r}")
    return {
        "prog": parser.prog,
        "no_help": no_help,
        "hidden_defaults": hidden_defaults,
        "subcommands": subcommands,
    }


def main() -> None:
    program, target, report, *args = sys.argv[1:]
    parsers: list[argparse.ArgumentParser] = []
    print_help = argparse.ArgumentParser.print_help

    def recording(self, file=None):
        parsers.append(self)
        return print_help(self, file)

    argparse.ArgumentParser.print_help = recording
    sys.argv = [program, *args]
    module, function = target.split(":")
    try:
        code = getattr(importlib.import_module(module), function)()  # as a console script
        code = code if isinstance(code, int) else 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    sys.stdout.flush()
    heavy = sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
    with open(report, "w") as handle:
        json.dump({"code": code, "heavy": heavy, "parsers": [describe(p) for p in parsers]}, handle)


if __name__ == "__main__":
    main()
