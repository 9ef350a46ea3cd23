"""The README is a test: every shell command it shows runs here, in order, as written.

``shell_commands`` reads the shell code blocks (```bash, ```sh, ```shell, ```console) of
README.md and of any docs page's Quickstart section, joins lines continued with a
backslash and drops a ``$ `` prompt. Each command then gets one treatment from ``RULES``
(the first rule whose section and start match it):

- ``run``: run by bash exactly as written, in a scratch folder that stands for a fresh
  clone (its ``configs/``), with this environment's ``cqk`` and ``torchrun`` first on
  ``PATH``; the commands share the folder, so the export reads the run trained above;
- ``dry-run``: a cluster command, run as written with ``--dry-run`` added;
- ``help``: the list of commands, each run with ``--help``;
- ``skip``: a command that cannot run on a CPU machine, or that is the demo or CI itself
  (run by their own tests), with the reason.

A README command that no rule covers fails, and so does a rule that covers nothing: a new
command in the README gets a decision here. ``cqk plan`` runs with its build check on.

A command that reads what an earlier one wrote (the export reads the run trained above,
the tokenizer the demo corpus) names it in its rule's ``after``: that command runs first
if it has not yet, so each case also runs alone (``-k``), and each command runs once.

Time: the training commands run at their written length (200 steps of a 140k-parameter
model: 13 s for one process; the 4-rank torchrun line is the longest, 44 s on a 2-core
machine, most of it four processes importing Megatron-Core and DeepSpeed), and the data
block builds the 4 MB demo corpus with its tokenizer and then a second tokenizer (58 s and
20 s, measured on a loaded machine).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SHELL_LANGUAGES = frozenset({"bash", "sh", "shell", "console"})
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
# Every command of `cqk`, and `check`: the README's command list names each one.
COMMANDS = (
    "check train torchrun submit status cancel plan params bench demo data convert analyze "
    "mqar repro"
).split()
COMMAND_TIMEOUT_S = 600  # the 4-rank torchrun line on a loaded 2-core machine


@dataclass(frozen=True)
class ShellCommand:
    """One logical shell line of a doc: where it starts, the section it sits in, the
    command and its trailing comment (``""`` if none)."""

    source: str
    line: int
    section: str
    command: str
    comment: str = ""

    @property
    def text(self) -> str:
        """The command and its comment, each run of whitespace one space (rules match it)."""
        return " ".join(f"{self.command} {self.comment}".split())

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.command}"


def shell_lines(text: str) -> Iterator[tuple[int, str, str]]:
    """``(first line number, section heading, logical line)`` of every non-blank line inside
    a shell code block, backslash continuations joined."""
    fence: str | None = None  # the open fence's marker, when inside a block
    in_shell, section = False, ""
    pending: tuple[int, str] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        if fence is None:
            heading, opened = HEADING.match(raw), FENCE.match(raw)
            if heading:
                section = heading.group(2)
            elif opened:
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
        if line:
            yield start, section, line


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


def shell_commands(text: str, source: str = "README.md") -> list[ShellCommand]:
    """Every command (not a comment line, not a console's output) of a doc's shell blocks."""
    found = []
    for number, section, line in shell_lines(text):
        prompted = line.startswith("$ ")
        line = line[2:].lstrip() if prompted else line
        at = comment_start(line)
        command, comment = line[:at].strip(), line[at:].strip()
        if command:
            found.append(ShellCommand(source, number, section, command, comment))
    return found


def quickstart_sections(text: str) -> str:
    """The Quickstart sections of a docs page (each heading with "quickstart" in it, to the
    next heading of the same level or above), as one text."""
    kept, level = [], 0
    for raw in text.splitlines():
        heading = HEADING.match(raw)
        if heading and (not level or len(heading.group(1)) <= level):
            level = len(heading.group(1)) if "quickstart" in heading.group(2).lower() else 0
        kept.append(raw if level else "")
    return "\n".join(kept)


def documented_commands() -> list[ShellCommand]:
    """README.md's commands, then those of the docs' Quickstart sections."""
    commands = shell_commands(README.read_text())
    for page in sorted((REPO / "docs").glob("*.md")):
        commands += shell_commands(quickstart_sections(page.read_text()), f"docs/{page.name}")
    return commands


# --- what each command gets -----------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """``action`` for the commands of ``section`` whose text starts with ``start``."""

    section: str
    start: str
    action: str  # run, dry-run, help or skip
    reason: str = ""
    # the starts of the earlier documented commands whose output this one reads
    after: tuple[str, ...] = ()


CLUSTER_NODE = "a CUDA cluster node's install (CUDA wheels, a filesystem every node mounts)"
ON_THE_CLUSTER = "acts on the 1B job that the submit above makes on a Slurm cluster"
LADDER_RUNS = (
    "reads the ladder's finished runs under the cluster's runs_root; "
    "tests/test_analysis.py runs table, fit and report on run folders"
)
TRAINED_RUN = "cqk train --config configs/runs/tiny_cpu.yaml # one process"  # runs/tiny-cpu
RULES = (
    Rule("Install", "bash scripts/install.sh", "skip", "the install itself: .ci/run runs it"),
    Rule("Install", "source .venv/bin/activate", "skip", "this test runs in that environment"),
    Rule("Install", "cqk check # on a GPU node", "skip", "the same command as above, run there"),
    Rule("Install", "cqk check", "run"),
    Rule("Install", "python3 -m venv /shared/", "skip", CLUSTER_NODE),
    Rule("Install", "pip install", "skip", CLUSTER_NODE),
    Rule("Quickstart", "bash scripts/demo.sh", "skip", "the demo: tests/test_demo.py runs it"),
    Rule("Quickstart", "bash .ci/run", "skip", "CI itself: it runs this test"),
    Rule(
        "Tests",
        "DS_ACCELERATOR=cpu .venv/bin/python -m pytest",
        "skip",
        "the suite's fast tier: CI runs every test",
    ),
    Rule("Training a run", "cqk ", "run"),
    Rule("Training a run", "torchrun ", "run"),
    Rule("On a Slurm cluster", "cqk plan", "run"),
    Rule("On a Slurm cluster", "cqk submit", "dry-run"),
    Rule("On a Slurm cluster", "cqk status", "skip", ON_THE_CLUSTER),
    Rule("On a Slurm cluster", "cqk cancel", "skip", ON_THE_CLUSTER),
    Rule("A scaling ladder", "cqk analyze ladder", "run"),
    Rule("A scaling ladder", "cqk submit", "dry-run"),
    Rule("A scaling ladder", "cqk analyze", "skip", LADDER_RUNS),
    Rule("Data preparation", "cqk data tokenizer", "run", after=("cqk data demo-corpus",)),
    Rule("Data preparation", "cqk data preprocess", "run", after=("cqk data tokenizer",)),
    Rule("Data preparation", "cqk data stats", "run", after=("cqk data preprocess",)),
    Rule("Data preparation", "cqk data", "run"),
    Rule("Export to Hugging Face", "cqk convert export", "run", after=(TRAINED_RUN,)),
    Rule("Export to Hugging Face", "cqk convert import", "run", after=("cqk convert export",)),
    Rule("Commands", "cqk ", "help"),
)


def rule_for(command: ShellCommand) -> Rule | None:
    for rule in RULES:
        if command.section.startswith(rule.section) and command.text.startswith(rule.start):
            return rule
    return None


def prerequisites(command: ShellCommand, documented: list[ShellCommand]) -> list[ShellCommand]:
    """The documented commands before ``command`` that its rule's ``after`` names."""
    rule = rule_for(command)
    earlier = documented[: documented.index(command)]
    starts = rule.after if rule else ()
    return [c for c in earlier if any(c.text.startswith(start) for start in starts)]


def script(command: ShellCommand, rule: Rule) -> str:
    """The bash line that checks ``command`` under ``rule``."""
    if rule.action == "help":
        return f"{command.command} --help"
    if rule.action == "dry-run" and "--dry-run" not in shlex.split(command.command):
        return f"{command.command} --dry-run"
    return command.command


# --- the parser, on a fixture -------------------------------------------------------------

FIXTURE = """\
# A README

## Training

```bash
# a comment line
cqk train --config configs/runs/tiny_cpu.yaml   # one process's run
pip install cqk
cqk submit --config configs/runs/1b_4x8.yaml \\
    --profile configs/clusters/example_h100.yaml --cluster slurm --dry-run
```

```console
$ cqk status runs/x
status of runs/x
```

```python
cqk train --config not_shell.yaml
```

## Data

- a list item with an indented block:

  ```sh
  cqk data stats "data/my corpus_text_document"  # quoted words stay one
  ```

~~~shell
cqk convert export RUN out/hf
~~~
"""


def test_the_parser_finds_every_command_of_the_shell_blocks_only():
    found = [(c.line, c.section, c.command, c.comment) for c in shell_commands(FIXTURE)]
    assert found == [
        (7, "Training", "cqk train --config configs/runs/tiny_cpu.yaml", "# one process's run"),
        (8, "Training", "pip install cqk", ""),
        (
            9,
            "Training",
            "cqk submit --config configs/runs/1b_4x8.yaml "
            "--profile configs/clusters/example_h100.yaml --cluster slurm --dry-run",
            "",
        ),
        (14, "Training", "cqk status runs/x", ""),
        (15, "Training", "status of runs/x", ""),  # a console's output reads as a command
        (27, "Data", 'cqk data stats "data/my corpus_text_document"', "# quoted words stay one"),
        (31, "Data", "cqk convert export RUN out/hf", ""),
    ]


def test_an_unclosed_continuation_ends_with_its_block():
    text = "```bash\ncqk train \\\n```\n\n```bash\ncqk status x\n```\n"
    assert [c.command for c in shell_commands(text)] == ["cqk status x"]


def test_a_hash_inside_quotes_or_a_word_is_not_a_comment():
    line = 'cqk data stats "a #b" c#d # needs a GPU'
    assert line[comment_start(line) :] == "# needs a GPU"


def test_a_docs_page_gives_its_quickstart_section_only():
    page = (
        "# P\n```bash\nno\n```\n## Quickstart\n```bash\nyes\n```\n### more\n```bash\nyes too\n```\n"
    )
    page += "## Next\n```bash\nno\n```\n"
    assert [c.command for c in shell_commands(quickstart_sections(page))] == ["yes", "yes too"]


def test_a_dry_run_is_added_once_and_help_to_a_listed_command():
    dry = ShellCommand("R", 1, "S", "cqk submit --config a.yaml --cluster slurm")
    assert script(dry, Rule("S", "", "dry-run")).endswith("--cluster slurm --dry-run")
    already = ShellCommand("R", 1, "S", "cqk submit --dry-run --config a.yaml")
    assert script(already, Rule("S", "", "dry-run")) == already.command
    assert script(ShellCommand("R", 1, "S", "cqk plan"), Rule("S", "", "help")) == "cqk plan --help"


# --- the README itself ------------------------------------------------------------------

DOCUMENTED = documented_commands()


def test_every_documented_command_has_a_rule_and_every_rule_a_command():
    uncovered = [str(command) for command in DOCUMENTED if rule_for(command) is None]
    assert not uncovered, f"no rule in {Path(__file__).name} for: {uncovered}"
    used = {rule_for(command) for command in DOCUMENTED}
    unused = [rule for rule in RULES if rule not in used]
    assert not unused, f"rules that match no documented command: {unused}"


def test_every_command_a_rule_runs_after_comes_before_it():
    """An ``after`` that names no earlier command would let a case run without its input."""
    for command in DOCUMENTED:
        rule = rule_for(command)
        found = prerequisites(command, DOCUMENTED)
        for start in rule.after if rule else ():
            assert any(c.text.startswith(start) for c in found), (
                f"{command}: nothing before it starts {start!r}"
            )


def test_every_skip_says_why():
    assert all(rule.reason for rule in RULES if rule.action == "skip")


def test_the_readme_names_every_command():
    named = {c.command.split()[1] for c in DOCUMENTED if c.command.startswith("cqk ")}
    assert set(COMMANDS) <= named, f"the README's shell blocks lack: {set(COMMANDS) - named}"


def test_the_training_examples_have_distinct_run_names():
    """Each training example is its own run: the same name would resume the first one."""
    starts = ("cqk train --config", "torchrun ", "cqk submit --config configs/runs/tiny_cpu")
    trains = [c.command for c in DOCUMENTED if c.command.startswith(starts)]
    names = [next((w for w in shlex.split(t) if w.startswith("name=")), "") for t in trains]
    assert len(trains) >= 4 and len(set(names)) == len(names), list(zip(trains, names, strict=True))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A folder standing for a fresh clone's root: its configs, nothing generated."""
    folder = tmp_path_factory.mktemp("readme")
    (folder / "configs").symlink_to(REPO / "configs", target_is_directory=True)
    return folder


def _env() -> dict[str, str]:
    """This environment's ``cqk`` and ``torchrun`` first on PATH, importing this checkout."""
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO),
        "DS_ACCELERATOR": "cpu",
    }


Outcomes = dict[ShellCommand, subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def outcomes() -> Outcomes:
    """What each command has done in ``scratch`` so far: each runs once."""
    return {}


def run_documented(command: ShellCommand, scratch: Path, outcomes: Outcomes) -> None:
    """Run ``command`` in ``scratch`` (after the commands it reads from), once, and check
    that it worked as its rule says."""
    rule = rule_for(command)
    assert rule is not None, f"no rule for {command}"
    for needed in prerequisites(command, DOCUMENTED):
        run_documented(needed, scratch, outcomes)
    line = script(command, rule)
    if command not in outcomes:
        outcomes[command] = subprocess.run(
            ["bash", "-c", line],
            cwd=scratch,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
    done = outcomes[command]
    report = (
        f"{command}\nran ({rule.action}): {line}\nexit {done.returncode}\n"
        f"stdout (end):\n{done.stdout[-1500:]}\nstderr (end):\n{done.stderr[-3000:]}"
    )
    assert done.returncode == 0 or refused_for_cluster_data(rule, done), report
    assert "Traceback" not in done.stdout + done.stderr, report


@pytest.mark.parametrize("command", DOCUMENTED, ids=str)
def test_every_documented_command_runs(command: ShellCommand, scratch: Path, outcomes: Outcomes):
    rule = rule_for(command)
    assert rule is not None, f"no rule for {command}"
    if rule.action == "skip":
        pytest.skip(f"{command}: {rule.reason}")
    run_documented(command, scratch, outcomes)


def refused_for_cluster_data(rule: Rule, done: subprocess.CompletedProcess[str]) -> bool:
    """A cluster submit's dry run that says no, as its submission would, only because the
    run's data lives on the cluster's shared filesystem (``/shared/...``), not here: the
    verdict first, exit 2, and every refusal about that data."""
    lines = done.stdout.splitlines()
    verdict = lines[0] if lines else ""
    # one run: "pre-flight: would be refused: WHY"; a sweep: "refusal [N] (K runs): WHY"
    refusals = [
        line for line in lines if line.startswith(("pre-flight: would be refused: ", "refusal ["))
    ]
    return (
        rule.action == "dry-run"
        and done.returncode == 2
        and verdict.startswith("pre-flight: ")
        and bool(refusals)
        and all("/shared/" in line or "data.prefixes is empty" in line for line in refusals)
    )
