"""Every path, config include and link that README.md and docs/ name exists, and every
source file that a config's comments name.

A doc that points at a file, a config include or a section that has moved sends a user to
nothing; this fails on it, naming the page, the line and what is missing.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from cqk_megatron.variants import VARIANTS

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Top-level folders of the repository: a path a doc names inside one of them must exist.
TRACKED_ROOTS = ("configs", "cqk_megatron", "data_tools", "docs", "launch", "scripts", "tests")
_ROOTS = "|".join(TRACKED_ROOTS)
PATH = re.compile(rf"(?<![\w./-])((?:{_ROOTS})/[\w./*-]*[\w/*])")
LINK = re.compile(r"\]\(([^)\s]+)\)")
INCLUDE = re.compile(r"include:\s*\[([^\]]*)\]")
# A test named by its pytest node id: tests/test_x.py::test_y (or ::TestClass::test_y).
NODE_ID = re.compile(r"(tests/[\w/]+\.py)((?:::\w+)+)")
PLACEHOLDER = re.compile(r"[A-Z]{3,}|NAME|\.\.\.|<|\*|/my\w*\.")  # runs/NAME.yaml, mysite.yaml


def _mentions(page: Path) -> list[tuple[int, str, str]]:
    """(line, kind, target) for each path, include and link of ``page``."""
    found = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        found += [(number, "path", m) for m in PATH.findall(line)]
        for group in INCLUDE.findall(line):
            found += [(number, "include", item.strip(" '\"")) for item in group.split(",")]
        found += [(number, "link", m) for m in LINK.findall(line)]
    return found


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of ``page``."""
    anchors = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def _missing_include(target: str) -> str | None:
    folder, _, name = target.rpartition("/")
    if folder == "variants":  # a preset of the variant registry, not a file
        ok = name.removesuffix(".yaml") in VARIANTS or PLACEHOLDER.search(name)
        return None if ok else f"include {target}: no registered variant preset of that name"
    return None if (REPO / "configs" / target).exists() else f"configs/{target} does not exist"


def _missing(page: Path, kind: str, target: str) -> str | None:
    if kind == "path":
        if PLACEHOLDER.search(target) or (REPO / target.rstrip("/")).exists():
            return None
        return f"{target} does not exist"
    if kind == "include":
        return _missing_include(target)
    if target.startswith(("http://", "https://", "mailto:")):
        return None
    file, _, anchor = target.partition("#")
    linked = (page.parent / file).resolve() if file else page
    if not linked.exists():
        return f"the link {target} leads to no file"
    if anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
        return f"the link {target} leads to no heading of {linked.name}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_named_path_exists(page: Path) -> None:
    problems = [
        f"{page.relative_to(REPO)}:{number}: {problem}"
        for number, kind, target in _mentions(page)
        if (problem := _missing(page, kind, target))
    ]
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_missing_path(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Run `configs/runs/nowhere.yaml`.\ninclude: [models/none.yaml, variants/nothing.yaml]\n"
        "See [there](missing.md) and [here](#no-such-heading).\n# A heading\n"
    )
    problems = [p for n, k, t in _mentions(page) if (p := _missing(page, k, t))]
    assert len(problems) == 5, problems


# A source file a config's comments name, with or without its folders (config/schema.py,
# launch/attempts.py): the comments are a config's documentation.
COMMENT_SOURCE = re.compile(r"(?<![\w./-])([\w/]*\w\.py)\b")


def _sources_named_in_comments(config: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(config.read_text().splitlines(), 1):
        comment = line.partition("#")[2]
        found += [(number, name) for name in COMMENT_SOURCE.findall(comment)]
    return found


def test_every_source_a_configs_comment_names_exists() -> None:
    sources = [p.relative_to(REPO).as_posix() for p in REPO.rglob("*.py") if ".venv" not in p.parts]
    problems = [
        f"{config.relative_to(REPO)}:{number}: no {name} in the repository"
        for config in sorted((REPO / "configs").rglob("*.yaml"))
        for number, name in _sources_named_in_comments(config)
        if not any(path == name or path.endswith(f"/{name}") for path in sources)
    ]
    assert not problems, "\n".join(problems)


def _defined_names(test_file: Path) -> set[str]:
    """The functions and classes ``test_file`` defines at its top level."""
    tree = ast.parse(test_file.read_text())
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {node.name for node in tree.body if isinstance(node, kinds)}


def _missing_tests(page: Path) -> list[str]:
    """``page:line: node id`` for each test node id of ``page`` whose test is not defined:
    a row of "what happens when" that names a renamed or deleted test promises nothing."""
    problems = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for file, parts in NODE_ID.findall(line):
            test_file, name = REPO / file, parts.split("::")[1]
            if not test_file.exists() or name not in _defined_names(test_file):
                problems.append(f"{page.relative_to(REPO)}:{number}: {file}{parts} is no test")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_named_test_exists(page: Path) -> None:
    problems = _missing_tests(page)
    assert not problems, "\n".join(problems)


def test_every_row_of_the_faults_table_names_a_test() -> None:
    rows = [
        line
        for line in (REPO / "docs" / "faults.md").read_text().splitlines()
        if line.startswith("| ") and not line.startswith(("| When", "|---"))
    ]
    unnamed = [row for row in rows if not NODE_ID.search(row.rsplit("|", 2)[-2])]
    assert rows and not unnamed, unnamed


def test_the_check_sees_a_test_that_is_not_there(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_here():\n    pass\n")
    page = tmp_path / "page.md"
    page.write_text(
        "`tests/test_x.py::test_here` `tests/test_x.py::test_gone` `tests/test_y.py::test_a`\n"
    )
    assert [p.split(": ", 1)[1] for p in _missing_tests(page)] == [
        "tests/test_x.py::test_gone is no test",
        "tests/test_y.py::test_a is no test",
    ]
