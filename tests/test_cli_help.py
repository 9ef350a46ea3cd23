"""Every command's ``--help`` (issue 29): each console script of setup.py and each ``cqk``
command, subcommand and sub-subcommand exits 0, names itself as typed in its usage line,
shows its defaults, names no old script name (``cqk-plan``, ``launch/submit.py``: its
``cqk`` command instead), prints no warning (an empty stderr), imports none of torch, Megatron,
DeepSpeed, transformers, pandas, matplotlib or scipy, and takes under 2 CPU-seconds; every
option has help text.

The commands come from setup.py's entry points and the dispatcher's table
(``cqk_megatron.__main__.COMMANDS``), and the subcommands of a parser from the parser
itself, so a new command is covered without touching this file. Each ``--help`` runs in a
fresh process (``tests/_cli_probe.py``), as the console script would.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from cqk_megatron.__main__ import COMMANDS, Command, resolve

REPO = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).with_name("_cli_probe.py")
CPU_LIMIT_S = 2.0
# The old script names, which a command's help gives as its cqk command instead.
OLD_NAMES = re.compile(
    r"(?<![\w/.])(cqk-(?:params|train|torchrun|plan|bench|convert|preprocess|data-stats"
    r"|demo-corpus|data-bench|analyze|submit|mqar|repro)(?![\w-])|launch/submit\.py)"
)


def console_scripts() -> dict[str, str]:
    """setup.py's ``console_scripts``, name -> ``module:function`` (read, not run)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "console_scripts":
                    entries = [ast.literal_eval(item) for item in value.elts]
                    return dict(entry.replace(" ", "").split("=", 1) for entry in entries)
    raise AssertionError("setup.py has no console_scripts")


def command_paths(commands: dict[str, Command], prefix: tuple[str, ...] = ()) -> list[tuple]:
    """Every path of the dispatcher's table: ("train",), ("data",), ("data", "stats"), ..."""
    paths = []
    for name, command in commands.items():
        paths.append((*prefix, name))
        paths += command_paths(command.subcommands, (*prefix, name))
    return paths


SCRIPTS = console_scripts()
CASES = [(name, target, ()) for name, target in SCRIPTS.items()] + [
    ("cqk", SCRIPTS["cqk"], path) for path in command_paths(COMMANDS)
]


def probe(program: str, target: str, args: tuple[str, ...], tmp_path: Path) -> dict:
    """``program *args --help`` in a fresh process: its report, streams and CPU time."""
    report = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # warnings shown
    env["PYTHONPATH"] = str(REPO)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [sys.executable, str(PROBE), program, target, str(report), *args, "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = json.loads(report.read_text()) if report.exists() else {}
    return {
        **result,
        "stdout": done.stdout,
        "stderr": done.stderr,
        "cpu": cpu,
        "rc": done.returncode,
    }


def check_help(program: str, target: str, args: tuple[str, ...], tmp_path: Path) -> list[str]:
    """The problems of ``args --help`` and, recursively, of its parser's subcommands."""
    shown = " ".join([program, *args, "--help"])
    result = probe(program, target, args, tmp_path)
    problems = []
    if result["rc"] != 0 or result.get("code") != 0:
        problems.append(f"{shown}: exit {result['rc']}: {result['stderr'][-2000:]}")
    if result["stderr"]:
        problems.append(f"{shown}: printed on stderr: {result['stderr'][-2000:]}")
    if not result["stdout"].strip():
        problems.append(f"{shown}: printed no help")
    usage = "usage: " + " ".join([program, *args])
    if program == "cqk" and not result["stdout"].startswith(usage):
        # as typed: "cqk submit", not the file's own name ("launch/submit.py")
        problems.append(f"{shown}: its usage line is not {usage!r}: {result['stdout'][:80]!r}")
    old_name = OLD_NAMES.search(result["stdout"])
    if program == "cqk" and args and old_name:  # `cqk --help` says once that they work
        problems.append(f"{shown}: names the old {old_name[0]!r}, not its cqk command")
    if result.get("heavy"):
        problems.append(f"{shown}: imported {result['heavy']}")
    if result["cpu"] >= CPU_LIMIT_S:
        problems.append(f"{shown}: {result['cpu']:.2f} CPU-seconds (limit {CPU_LIMIT_S})")
    for parser in result.get("parsers", []):
        problems += [f"{shown}: {name} has no help text" for name in parser["no_help"]]
        problems += [f"{shown}: default not shown: {item}" for item in parser["hidden_defaults"]]
        for sub in parser["subcommands"]:
            problems += check_help(program, target, (*args, sub), tmp_path)
    return problems


@pytest.mark.parametrize(
    ("program", "target", "args"), CASES, ids=[" ".join([p, *a]) for p, _, a in CASES]
)
def test_help_is_quick_quiet_light_and_complete(program, target, args, tmp_path):
    problems = check_help(program, target, args, tmp_path)
    assert not problems, "\n".join(problems)


def test_every_entry_point_and_command_resolves():
    """setup.py's targets and the dispatcher's name functions that exist, and the old
    script names all stay (they are aliases of ``cqk`` commands)."""
    old_names = {
        "cqk-params", "cqk-train", "cqk-torchrun", "cqk-plan", "cqk-bench", "cqk-convert",
        "cqk-train-tokenizer", "cqk-preprocess", "cqk-data-stats", "cqk-demo-corpus",
        "cqk-data-bench", "cqk-analyze", "cqk-submit", "cqk-mqar", "cqk-repro",
    }  # fmt: skip
    assert old_names | {"cqk"} <= set(SCRIPTS)
    assert SCRIPTS["cqk"] == "cqk_megatron.__main__:main"
    for target in SCRIPTS.values():
        assert callable(resolve(target)), target
    for path in command_paths(COMMANDS):
        command = COMMANDS[path[0]]
        for name in path[1:]:
            command = command.subcommands[name]
        assert command.target or command.subcommands, path
        if command.target:
            assert callable(resolve(command.target)), path


def test_the_overview_lists_every_command(capsys):
    from cqk_megatron.__main__ import main

    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in COMMANDS)
    assert main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["status", "cancel"])
def test_status_and_cancel_are_launch_submit_py_status_and_cancel(command, tmp_path):
    """``cqk status|cancel X`` does what ``python launch/submit.py status|cancel X`` does:
    same exit code, same output (the program name apart)."""
    missing = str(tmp_path / "no-such-run")
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )

    old = run(["launch/submit.py", command, missing])
    new = run(["-m", "cqk_megatron", command, missing])
    assert old.returncode == new.returncode != 0
    assert (old.stdout, old.stderr) == (new.stdout, new.stderr)
    assert missing in old.stdout + old.stderr


def test_old_flag_spellings_are_hidden_aliases():
    """``--out``/``--force``/``--variants`` take the old spellings (``--out-dir``,
    ``--output``, ``--output-prefix``, ``--overwrite``, ``--variant``), which ``--help``
    does not show."""
    from cqk_megatron.cli import convert, mqar, plan
    from data_tools import preprocess, tokenizer

    plan_argv = ["--config", "c", "--gpus", "1"]
    data_argv = ["--input", "i", "--output-prefix", "X", "--overwrite"]
    cases = [
        (mqar.build_parser(), ["--out-dir", "X"], "out", "X"),
        (convert.build_parser(), ["export", "a", "b", "--overwrite"], "force", True),
        (convert.build_parser(), ["import", "a", "b", "--overwrite"], "force", True),
        (plan.build_parser(), [*plan_argv, "--variant", "coupled"], "variants", "coupled"),
        (preprocess.build_parser(), [*data_argv, "--tokenizer", "t"], "out", "X"),
        (preprocess.build_parser(), [*data_argv, "--tokenizer", "t"], "force", True),
        (tokenizer.build_parser(), data_argv, "out", "X"),
        (tokenizer.build_parser(), data_argv, "force", True),
    ]
    for parser, argv, dest, value in cases:
        assert getattr(parser.parse_args(argv), dest) == value, argv
        text = parser.format_help() + "".join(
            sub.format_help()
            for action in parser._actions
            if isinstance(action, argparse._SubParsersAction)
            for sub in action.choices.values()
        )
        for old in ("--out-dir", "--output-prefix", "--overwrite", "--variant "):
            assert old not in text, (old, parser.prog)
    with pytest.raises(SystemExit):  # a required --out is still required under its new name
        preprocess.build_parser().parse_args(["--input", "i", "--tokenizer", "t"])


def test_constants_written_out_for_a_light_parser_agree():
    """Where a parser could not import a constant without pandas, the copy agrees."""
    from cqk_megatron.analysis import compare
    from cqk_megatron.bench import variants as perf_bench
    from cqk_megatron.cli import analyze, bench

    assert analyze.TOKENS_PER_PARAM == compare.TOKENS_PER_PARAM
    assert bench.CLOCK_NAMES == tuple(perf_bench.CLOCKS)


def test_cqk_plan_plans_each_of_several_variants(capsys):
    from cqk_megatron.cli.plan import main

    argv = ["--config", "configs/models/1b.yaml", "--gpus", "8", "--no-build-check"]
    assert main([*argv, "--variants", "standard,coupled"]) == 0
    headers = [line for line in capsys.readouterr().out.splitlines() if " GPUs x " in line]
    assert [h.split(":")[1].split(",")[0].strip() for h in headers] == ["standard", "coupled"]
