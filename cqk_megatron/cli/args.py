"""What every command's parser shares: the help format (defaults shown), the program name
under ``cqk``, and the unified flag names with their old spellings as hidden aliases.

Unified names: ``--out`` (was ``--out-dir``, ``--output``, ``--output-prefix``),
``--force`` (was ``--overwrite``), ``--variants`` (was ``--variant``), ``--config`` (its
help says which kind of file).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions and epilogs as written; each option's default after its help, unless
    the help already shows it (``%(default)s``) or there is nothing to show (no default,
    an on/off flag, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or not shows_a_default(action):
            return text
        return f"{text} (default: %(default)s)"


def shows_a_default(action: argparse.Action) -> bool:
    """Whether ``action`` has a default a reader needs to see: not None, not suppressed,
    not an empty list, not the off state of an on/off flag (``store_true``)."""
    default = action.default
    if default is None or default is argparse.SUPPRESS or default in ([], ()):
        return False
    if isinstance(default, bool) and action.nargs == 0:
        return False
    return action.help is not argparse.SUPPRESS


def program(fallback: str) -> str:
    """The name a parser shows in its usage line (and errors): ``cqk plan`` under the
    ``cqk`` dispatcher, the old console script's own name (an alias), else ``fallback``, the
    command's ``cqk`` name (``python -m ...`` and in-process calls, where ``sys.argv[0]``
    is a file path)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("cqk") else fallback


def subcommand_program(parent_fallback: str, command: str) -> str:
    """The usage name of ``command`` reached through a parent command: ``cqk status`` as
    typed under the dispatcher, else the parent's name and ``command``
    (``cqk status``)."""
    prog = program(parent_fallback)
    return prog if prog.endswith(f" {command}") else f"{prog} {command}"


def plain(text: str | None) -> str | None:
    """A docstring's paragraph for the terminal: without reStructuredText's double
    backquotes."""
    return None if text is None else text.replace("``", "")


def new_parser(
    fallback_prog: str, description: str, epilog: str | None = None, **kwargs: Any
) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with the shared help format (the docstrings' ````name````
    markup shown as plain ``name``)."""
    return argparse.ArgumentParser(
        prog=program(fallback_prog),
        description=plain(description),
        epilog=plain(epilog),
        formatter_class=HelpFormatter,
        **kwargs,
    )


def add_renamed(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    old: Sequence[str],
    **kwargs: Any,
) -> argparse.Action:
    """Add option ``flag`` and, for each spelling in ``old``, a hidden alias that sets the
    same value (not shown in ``--help``; a script written for the old name keeps working).

    ``required=True`` is kept with the aliases: the option and its aliases form a required
    group of which exactly one must be given."""
    required = kwargs.pop("required", False)
    target = parser.add_mutually_exclusive_group(required=True) if required else parser
    action = target.add_argument(flag, **kwargs)
    alias_kwargs = {k: v for k, v in kwargs.items() if k not in ("help", "default", "dest")}
    for spelling in old:
        target.add_argument(
            spelling,
            dest=action.dest,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
            **alias_kwargs,
        )
    return action


def add_out(parser: argparse.ArgumentParser, help: str, old: Sequence[str] = (), **kwargs: Any):
    """``--out`` (what it names, file, folder or prefix, is in ``help``)."""
    return add_renamed(parser, "--out", old, help=help, **kwargs)


def add_force(parser: argparse.ArgumentParser, help: str, old: Sequence[str] = ("--overwrite",)):
    """``--force``: replace what is there (old spelling ``--overwrite``)."""
    return add_renamed(parser, "--force", old, action="store_true", help=help)
