"""One word, one concept (docs/development.md, "Names"): the names that once meant a second
thing do not come back.

Each old name below was a second meaning of "plan", "backend", "layout" or of the math
file's name, and was renamed. The test reads every source, test, doc and config of the
repository as text (comments, docstrings and messages count: they are where a reader meets
the word) and fails naming the file, the line and the name that replaced it. An old name
still read on purpose would be listed in ``KEPT`` with where and why.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCANNED = (
    "cqk_megatron/**/*.py",
    "launch/**/*.py",
    "data_tools/**/*.py",
    "tests/**/*.py",
    "docs/*.md",
    "configs/**/*.yaml",
    "scripts/**/*.sh",
    "README.md",
)
THIS_FILE = Path(__file__).resolve()

# old name (a whole word) -> what it is called now
RENAMED = {
    "RunPlan": "launch.resolve.RunSpec",
    "plan_run": "launch.resolve.resolve_run",
    "plan_sweep": "launch.resolve.resolve_sweep",
    "PlannedRun": "repro.configs.ReproRun",
    "build_plan": "repro.configs.build_reproduction",
    "planned_runs": "cli.mqar.requested_runs",
    "ResumePlan": "training.checkpoint.ResumeMode",
    "resume_plan": "training.checkpoint.resume_mode",
    "MATH_FILE": "convert.remote_source.EXPORTED_MATH_FILE / variants.registry.PLAIN_MATH_SOURCE",
    "COUPLING_FILE": "convert.remote_source.EXPORTED_MATH_FILE",
    "coupling_module": "variants.plain_math",
    "sdpa_backend": "model.attention.sdpa.chosen_sdpa_kernel",
    "SDPA_BACKENDS": "model.attention.sdpa.SDPA_KERNELS",
    "wide_value_backend": "wide_value_kernel",
    "FAST_WIDE_VALUE_BACKENDS": "FAST_WIDE_VALUE_KERNELS",
    "ModelLayout": "convert.names.ModelShape",
    "gpt2_layout": "convert.gpt2_names",
}
# Patterns that are not one word
RENAMED_PATTERNS = {
    r"\bclass Plan\b": "repro.configs.Reproduction",
    r"\bdef backend\(": "parallel.process_groups.collective_library",
    r"\bprocess_groups\.backend\b": "parallel.process_groups.collective_library",
}
# (old name, file) pairs that are read on purpose, with why (none now)
KEPT: set[tuple[str, str]] = set()
# "coupling.py" is plain_math.py's name inside an exported Hugging Face folder, and only
# there: these files speak of the export; elsewhere a line that names it says what it is
# (names plain_math.py too).
EXPORT_FILES = (
    "cqk_megatron/convert/",
    "docs/huggingface.md",
    "tests/test_convert.py",
)
EXPORTED_MATH = re.compile(r"(?<![\w/])coupling\.py\b")


def old_names() -> re.Pattern[str]:
    words = [rf"\b{re.escape(name)}\b" for name in RENAMED]
    return re.compile("|".join([*words, *RENAMED_PATTERNS]))


OLD_NAME = old_names()


def replacement(found: str) -> str:
    if found in RENAMED:
        return RENAMED[found]
    return next(new for pattern, new in RENAMED_PATTERNS.items() if re.fullmatch(pattern, found))


def mentions(text: str) -> Iterator[tuple[int, str]]:
    """``(line, old name)`` of every old name in ``text``."""
    for number, line in enumerate(text.splitlines(), 1):
        for match in OLD_NAME.finditer(line):
            yield number, match.group(0)


def source_math_mentions(text: str) -> Iterator[int]:
    """Lines that name ``coupling.py`` (not ``fast_coupling.py`` or ``test_coupling.py``)
    without saying it is ``plain_math.py``."""
    for number, line in enumerate(text.splitlines(), 1):
        if EXPORTED_MATH.search(line) and "plain_math.py" not in line:
            yield number


def scanned_files() -> list[Path]:
    found = {path for pattern in SCANNED for path in REPO.glob(pattern)}
    return sorted(path for path in found if path.resolve() != THIS_FILE)


def relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


# --- the check, on fixtures -------------------------------------------------------------------


def test_the_check_sees_each_kind_of_old_name():
    text = (
        "from launch.resolve import RunPlan\n"
        "class Plan:\n"
        "def backend() -> str:\n"
        "see process_groups.backend and sdpa_backend(q, k, v)\n"
        "a RunPlanner, a Planner and a backend_names() are other words\n"
    )
    assert list(mentions(text)) == [
        (1, "RunPlan"),
        (2, "class Plan"),
        (3, "def backend("),
        (4, "process_groups.backend"),
        (4, "sdpa_backend"),
    ]
    assert replacement("def backend(") == "parallel.process_groups.collective_library"


def test_the_check_tells_the_math_file_from_its_neighbours():
    text = (
        "the math of coupling.py\nfast_coupling.py\ntests/test_coupling.py\n"
        "variants/plain_math.py\nan export's coupling.py (plain_math.py)\n"
    )
    assert list(source_math_mentions(text)) == [1]


# --- the repository ---------------------------------------------------------------------------


def test_no_old_name_comes_back():
    found = [
        f"{relative(path)}:{line}: {name} (now {replacement(name)})"
        for path in scanned_files()
        for line, name in mentions(path.read_text(errors="replace"))
        if (name, relative(path)) not in KEPT
    ]
    assert not found, "old names (docs/development.md, Names):\n" + "\n".join(found)


def test_coupling_py_names_only_the_exported_math_file():
    found = [
        f"{relative(path)}:{line}"
        for path in scanned_files()
        if not relative(path).startswith(EXPORT_FILES)
        for line in source_math_mentions(path.read_text(errors="replace"))
    ]
    assert not found, (
        "coupling.py names the math file inside an exported folder only; the source is "
        "cqk_megatron/variants/plain_math.py:\n" + "\n".join(found)
    )


def test_one_parameter_count_function_and_one_math_file_constant():
    defined = {
        "count_parameters": re.compile(r"^\s*def count_parameters\(", re.M),
        "EXPORTED_MATH_FILE": re.compile(r"^EXPORTED_MATH_FILE\s*=", re.M),
        "PLAIN_MATH_SOURCE": re.compile(r"^PLAIN_MATH_SOURCE\s*=", re.M),
    }
    where: dict[str, list[str]] = {name: [] for name in defined}
    for path in sorted(REPO.glob("cqk_megatron/**/*.py")):
        text = path.read_text()
        for name, pattern in defined.items():
            where[name] += [relative(path)] * len(pattern.findall(text))
    assert where == {
        "count_parameters": ["cqk_megatron/model/gpt.py"],
        "EXPORTED_MATH_FILE": ["cqk_megatron/convert/remote_source.py"],
        "PLAIN_MATH_SOURCE": ["cqk_megatron/variants/registry.py"],
    }


def repeated_module_names(package: Path) -> dict[str, list[str]]:
    """``{file name: [paths]}`` for each module name that two files of ``package`` (a folder
    of ``cqk_megatron/`` with its subfolders) share; ``__init__`` and ``__main__`` aside."""
    seen: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        if path.stem not in ("__init__", "__main__") and "hf_remote" not in path.parts:
            seen.setdefault(path.name, []).append(str(path.relative_to(package.parent)))
    return {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_no_two_modules_of_one_name_inside_a_package():
    """``training/metrics.py`` and ``training/callbacks/metrics.py`` once both existed: an
    import or a traceback that says ``metrics.py`` must say which."""
    packages = [p for p in sorted((REPO / "cqk_megatron").iterdir()) if p.is_dir()]
    found = {p.name: repeated_module_names(p) for p in packages if repeated_module_names(p)}
    assert not found, found


def test_the_module_name_check_sees_a_repeat(tmp_path):
    (tmp_path / "callbacks").mkdir()
    for path in ("metrics.py", "callbacks/metrics.py", "callbacks/__init__.py", "__init__.py"):
        (tmp_path / path).write_text("")
    found = repeated_module_names(tmp_path)
    assert list(found) == ["metrics.py"]
