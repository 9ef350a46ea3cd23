"""One name everywhere: what a user reads says ``cqk <command>``, never an old script name.

The old names are the console scripts of setup.py other than ``cqk`` (``cqk-train``,
``cqk-plan``, ...). They keep working as aliases, and README.md says so in one paragraph;
nothing else a user reads names them: no docs page, config or script header, and no
string of the package's code (messages, help texts, which come from docstrings too, and the
commands a record writes), nor of the GPU acceptance command. This fails naming the file,
the line and the old name, so a message that brings one back is caught where it is written.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# Where a user reads text: pages and headers (every line), and code (its strings).
TEXT_FILES = ("docs/*.md", "configs/**/*.yaml", "scripts/**/*.sh", "scripts/**/*.in")
CODE_FILES = ("cqk_megatron/**/*.py", "launch/**/*.py", "data_tools/**/*.py", "tests/gpu/*.py")


def old_names(setup_text: str) -> list[str]:
    """The console scripts that ``setup_text`` declares, ``cqk`` itself left out."""
    return [name for name in re.findall(r'"(cqk-[\w-]+)\s*=', setup_text) if name != "cqk"]


def old_name_pattern(names: list[str]) -> re.Pattern[str]:
    """A whole old name: not part of a longer word, a path or a folder prefix
    (``cqk-data-bench-`` of a temporary folder is not ``cqk-data-bench``)."""
    longest_first = sorted(map(re.escape, names), key=len, reverse=True)
    return re.compile(rf"(?<![\w/.-])({'|'.join(longest_first)})(?![\w-])")


OLD_NAME = old_name_pattern(old_names((REPO / "setup.py").read_text()))


def text_mentions(text: str) -> Iterator[tuple[int, str]]:
    """``(line, old name)`` of every old name in a page or header."""
    for number, line in enumerate(text.splitlines(), 1):
        for name in OLD_NAME.findall(line):
            yield number, name


def code_mentions(source: str) -> Iterator[tuple[int, str]]:
    """``(line, old name)`` of every old name in the string literals of Python ``source``
    (comments are for developers; strings are printed, shown as help or recorded)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for name in OLD_NAME.findall(node.value):
                yield node.lineno, name


def files(patterns: tuple[str, ...]) -> list[Path]:
    return sorted({path for pattern in patterns for path in REPO.glob(pattern)})


def readme_paragraphs_naming_old_names(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if OLD_NAME.search(p)]


# --- the check, on fixtures -----------------------------------------------------------------


def test_the_old_names_come_from_setup_py():
    setup = '"cqk=cqk_megatron.__main__:main",\n"cqk-train=m:main",\n"cqk-data-stats=d:main",'
    assert old_names(setup) == ["cqk-train", "cqk-data-stats"]
    names = set(old_names((REPO / "setup.py").read_text()))
    assert {"cqk-train", "cqk-plan", "cqk-bench", "cqk-convert", "cqk-submit"} <= names


def test_the_check_sees_an_old_name_in_a_message_a_doc_and_a_header():
    code = 'def f():\n    # cqk-train in a comment is for developers\n    print("see cqk-bench")\n'
    assert list(code_mentions(code)) == [(3, "cqk-bench")]
    doc = "Run `cqk train`.\nOr `cqk-train-tokenizer --input x`, then cqk-plan.\n"
    assert list(text_mentions(doc)) == [(2, "cqk-train-tokenizer"), (2, "cqk-plan")]
    kept = "/tmp/cqk-data-bench-x, data/cqk-train.log, cqk-megatron, cqk-attempt: begins"
    assert list(text_mentions(kept)) == []


# --- the repository -----------------------------------------------------------------------


def test_no_page_header_or_message_uses_an_old_name():
    found = [
        f"{path.relative_to(REPO)}:{number}: {name}"
        for path in files(TEXT_FILES)
        for number, name in text_mentions(path.read_text())
    ]
    found += [
        f"{path.relative_to(REPO)}:{number}: {name} (a string of the code)"
        for path in files(CODE_FILES)
        for number, name in code_mentions(path.read_text())
    ]
    assert not found, "old script names where a user reads (say `cqk <command>`):\n" + "\n".join(
        found
    )


def test_the_readme_says_once_that_the_old_names_still_work():
    paragraphs = readme_paragraphs_naming_old_names(README.read_text())
    assert len(paragraphs) == 1, paragraphs
    assert "still work" in paragraphs[0], paragraphs[0]
