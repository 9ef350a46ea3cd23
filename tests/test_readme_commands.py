"""Every ``cqk`` command the README shows exists and takes the arguments it shows.

``readme_commands`` reads README.md's shell code blocks (```bash, ```sh, ```shell,
```console), joins lines continued with a backslash, drops a ``$ `` prompt, and keeps
every line that starts with ``cqk ``. Each is run as ``python -m cqk_megatron ...``:

- a submit (``cqk submit`` with arguments) with ``--dry-run`` (added where the line lacks
  it): the configs, profile and layout it names are validated and nothing is submitted;
- every other line with ``--help`` appended: the command and its subcommands exist;
- a line whose trailing comment is ``# needs a cluster`` or ``# needs a GPU`` only with
  ``--help``, since it would act on a machine this one is not.

A command the README names and the code lacks fails here. ``--help`` stops argparse where
it stands, so it proves the (sub)commands, not every flag after them; the submits' dry runs
check their flags too. Shell syntax other than words and a trailing comment (pipes,
``&&``, ``VAR=value cqk ...``) is not read: the README keeps its ``cqk`` lines plain.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SHELL_LANGUAGES = frozenset({"bash", "sh", "shell", "console"})
HELP_ONLY_MARKS = ("# needs a cluster", "# needs a GPU")
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
# Every command of issue 29's `cqk` (COMMON_CLI), and `check`: the README's command list
# names each one, so each one's --help runs below.
COMMANDS = (
    "check train torchrun submit status cancel plan params bench demo data convert analyze "
    "mqar repro"
).split()


@dataclass(frozen=True)
class ReadmeCommand:
    """One ``cqk`` line of the README: where it starts, its words after ``cqk``, and
    whether it is marked as needing a cluster or a GPU."""

    line: int
    words: tuple[str, ...]
    help_only: bool

    @property
    def is_submit(self) -> bool:
        """A submit of something (``cqk submit`` alone, as in a list of commands, has
        nothing to dry-run and gets ``--help``)."""
        return self.words[:1] == ("submit",) and len(self.words) > 1

    def argv(self) -> list[str]:
        """The arguments to ``python -m cqk_megatron`` that check this line."""
        if self.is_submit and not self.help_only:
            dry = () if "--dry-run" in self.words else ("--dry-run",)
            return [*self.words, *dry]
        return [*self.words, "--help"]

    def __str__(self) -> str:
        mark = " (help only)" if self.help_only else ""
        return f"README.md:{self.line}: cqk {shlex.join(self.words)}{mark}"


def shell_lines(text: str) -> list[tuple[int, str]]:
    """``(first line number, logical line)`` of every line inside a shell code block, with
    backslash continuations joined."""
    found: list[tuple[int, str]] = []
    fence: str | None = None  # the open fence's marker, when inside a block
    in_shell = False
    pending: tuple[int, str] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        opened = FENCE.match(raw)
        if fence is None:
            if opened:
                fence, in_shell = opened.group(1), opened.group(2).lower() in SHELL_LANGUAGES
            continue
        if raw.strip().startswith(fence[0] * len(fence)) and not raw.strip().strip(fence[0]):
            fence, pending = None, None
            continue
        if not in_shell:
            continue
        start, sofar = pending if pending else (number, "")
        line = sofar + raw.strip()
        if line.endswith("\\"):
            pending = (start, line[:-1].rstrip() + " ")
            continue
        pending = None
        found.append((start, line))
    return found


def parse_command(number: int, line: str) -> ReadmeCommand | None:
    """The ``cqk`` command on one logical shell line, or None if the line is not one."""
    if line.startswith("$ "):
        line = line[2:].lstrip()
    if not line.startswith("cqk "):
        return None
    at = comment_start(line)
    comment = line[at:]
    help_only = any(comment.startswith(mark) for mark in HELP_ONLY_MARKS)
    return ReadmeCommand(number, tuple(shlex.split(line[:at])[1:]), help_only)


def comment_start(line: str) -> int:
    """Where the shell comment of ``line`` begins (``len(line)`` if it has none): a ``#``
    that starts a word outside quotes. The comment's own text may hold quotes."""
    quote: str | None = None
    for at, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (at == 0 or line[at - 1].isspace()):
            return at
    return len(line)


def readme_commands(text: str) -> list[ReadmeCommand]:
    """Every ``cqk`` command in the shell code blocks of a README's text."""
    commands = (parse_command(number, line) for number, line in shell_lines(text))
    return [command for command in commands if command is not None]


# --- the parser, on a fixture -------------------------------------------------------------

FIXTURE = """\
# A README

```bash
# a comment line
cqk train --config configs/runs/tiny_cpu.yaml   # one process's run
pip install cqk
cqk-train --config old.yaml
cqk submit --config configs/runs/1b_4x8.yaml \\
    --profile configs/clusters/example_h100.yaml --cluster slurm --dry-run
cqk submit --config a.yaml --cluster slurm   # needs a cluster
cqk submit --config a.yaml --cluster local
cqk submit               # submit runs: the list of commands
```

```console
$ cqk status runs/x
status of runs/x
$ cqk bench --variants standard,coupled   # needs a GPU: measures on CUDA
```

```python
cqk train --config not_shell.yaml
```

```yaml
cqk train: not a command
```

- a list item with an indented block:

  ```sh
  cqk data stats "data/my corpus_text_document"  # quoted words stay one
  ```

~~~shell
cqk convert export RUN out/hf
~~~
"""


def test_the_parser_finds_every_cqk_line_of_the_shell_blocks_only():
    commands = readme_commands(FIXTURE)
    assert [(c.line, c.words, c.help_only) for c in commands] == [
        (5, ("train", "--config", "configs/runs/tiny_cpu.yaml"), False),
        (
            8,
            (
                "submit",
                "--config",
                "configs/runs/1b_4x8.yaml",
                "--profile",
                "configs/clusters/example_h100.yaml",
                "--cluster",
                "slurm",
                "--dry-run",
            ),
            False,
        ),
        (10, ("submit", "--config", "a.yaml", "--cluster", "slurm"), True),
        (11, ("submit", "--config", "a.yaml", "--cluster", "local"), False),
        (12, ("submit",), False),
        (16, ("status", "runs/x"), False),
        (18, ("bench", "--variants", "standard,coupled"), True),
        (32, ("data", "stats", "data/my corpus_text_document"), False),
        (36, ("convert", "export", "RUN", "out/hf"), False),
    ]


def test_each_line_is_checked_by_help_or_by_a_dry_run():
    by_line = {command.line: command.argv() for command in readme_commands(FIXTURE)}
    assert by_line[5] == ["train", "--config", "configs/runs/tiny_cpu.yaml", "--help"]
    assert by_line[8][-1] == "--dry-run" and by_line[8].count("--dry-run") == 1  # not doubled
    assert by_line[10] == ["submit", "--config", "a.yaml", "--cluster", "slurm", "--help"]
    assert by_line[11] == ["submit", "--config", "a.yaml", "--cluster", "local", "--dry-run"]
    assert by_line[12] == ["submit", "--help"]
    assert by_line[18] == ["bench", "--variants", "standard,coupled", "--help"]


def test_an_unclosed_continuation_ends_with_its_block():
    text = "```bash\ncqk train \\\n```\n\n```bash\ncqk status x\n```\n"
    assert [c.words for c in readme_commands(text)] == [("status", "x")]


# --- the README itself ------------------------------------------------------------------

README_COMMANDS = readme_commands(README.read_text())


def test_the_readme_names_every_command():
    named = {command.words[0] for command in README_COMMANDS}
    assert set(COMMANDS) <= named, f"the README's shell blocks lack: {set(COMMANDS) - named}"


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO),
        "DS_ACCELERATOR": "cpu",
        "PYTHONWARNINGS": "ignore",
    }


def _refused_for_cluster_data(command: ReadmeCommand, done: subprocess.CompletedProcess) -> bool:
    """A cluster submit's dry run, refused (exit 2, the verdict first) for data that lives
    on the cluster's shared filesystem and not here: what its submission would do here."""
    first = (done.stdout.splitlines() or [""])[0]
    return (
        command.is_submit
        and done.returncode == 2
        and first.startswith("pre-flight: ")
        and "would be refused" in first
        and any(cause in done.stdout for cause in ("not found", "data.prefixes is empty"))
    )


@pytest.mark.parametrize("command", README_COMMANDS, ids=str)
def test_every_readme_command_runs(command: ReadmeCommand):
    done = subprocess.run(
        [sys.executable, "-m", "cqk_megatron", *command.argv()],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0 or _refused_for_cluster_data(command, done), (
        f"{command}\nran: python -m cqk_megatron {shlex.join(command.argv())}\n"
        f"exit {done.returncode}\nstdout (end):\n{done.stdout[-1500:]}\n"
        f"stderr (end):\n{done.stderr[-3000:]}"
    )


def test_a_hash_inside_quotes_or_a_word_is_not_a_comment():
    line = 'cqk data stats "a #b" c#d # needs a GPU'
    assert line[comment_start(line) :] == "# needs a GPU"
    assert parse_command(1, line) == ReadmeCommand(1, ("data", "stats", "a #b", "c#d"), True)
