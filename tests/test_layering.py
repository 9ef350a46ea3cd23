"""The house rules of docs/architecture.md, as tests that fail when a change breaks them.

Read from the source (``ast``), not by importing: every ``import`` counts, also one inside
a function, since a lazy import is a dependency all the same. A package here is a folder
of ``cqk_megatron/`` (``cqk_megatron.model``), a module at its top (``cqk_megatron.train``),
``launch`` or ``data_tools``.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OURS = ("cqk_megatron", "launch", "data_tools")
ENGINES = ("torch", "megatron", "deepspeed", "transformer_engine", "apex", "transformers")
MAX_TOP_LEVEL_FILES = 5
# The parsers' house style (help with defaults, renamed flags): it imports only the
# standard library, so every command line may use it, wherever it lives.
ARGS = "cqk_megatron.cli.args"
# The engines' torch-free half (training/engines/: the package itself, its registry, the
# spec base, the sharding names and each engine's *_spec module): config.validate runs the
# engines' rules on login nodes without torch, so it sits in config's layer, and a test
# holds it there (no torch, no engine class, nothing above config). The engine classes
# (base.py and one module per engine) are training's.
ENGINE_SPECS = "cqk_megatron.training.engines"
ENGINE_SPEC_MODULES = ("registry", "spec", "shardings")
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, with_type_checking: bool = True) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in the file; ``from a import b`` yields
    ``a`` and ``a.b`` (b may be a module). ``with_type_checking=False`` leaves out the imports
    under ``if TYPE_CHECKING:``, which never run (the module-cycle test)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skipped = set() if with_type_checking else _under_type_checking(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def _under_type_checking(tree: ast.Module) -> set[int]:
    guards = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
    ]
    return {id(n) for guard in guards for stmt in guard.body for n in ast.walk(stmt)}


def _sources() -> list[Path]:
    found = []
    for top in OURS:
        found += sorted((REPO / top).rglob("*.py"))
    # the exported Hugging Face code runs outside this package, with its own relative imports
    return [p for p in found if "hf_remote" not in p.parts]


def _is_engine_spec(module: str) -> bool:
    """A module of the engines' torch-free half, or a name imported from the package
    itself (its ``__init__`` re-exports the registry)."""
    if not _is(module, ENGINE_SPECS):
        return False
    name = module[len(ENGINE_SPECS) + 1 :].split(".")[0]
    folder = REPO / ENGINE_SPECS.replace(".", "/")
    return (
        name in ENGINE_SPEC_MODULES
        or name.endswith("_spec")
        or not (folder / f"{name}.py").exists()  # the package, or a name it re-exports
    )


def _unit(module: str) -> str:
    """The package a module belongs to, for the package graph. A package's ``__main__.py``
    (``python -m cqk_megatron.analysis``), which only dispatches to its command, belongs to
    the command line."""
    parts = module.split(".")
    if module == ARGS or module.startswith(ARGS + "."):
        return ARGS
    if _is_engine_spec(module):
        return ENGINE_SPECS
    if parts[0] == "cqk_megatron" and len(parts) > 2 and parts[-1] == "__main__":
        return "cqk_megatron.cli"
    return ".".join(parts[:2]) if parts[0] == "cqk_megatron" and len(parts) > 1 else parts[0]


def _is(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _violations(files: list[Path], forbidden: tuple[str, ...], rule: str) -> list[str]:
    return [
        f"{path.relative_to(REPO)}:{line} imports {module}: {rule}"
        for path in files
        for line, module in _imports(path)
        if _is(module, *forbidden)
    ]


def _files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def test_the_house_style_of_parsers_imports_only_the_standard_library():
    path = REPO / "cqk_megatron/cli/args.py"
    assert _violations([path], OURS + ENGINES, "every command line uses it") == []


def _engine_spec_files() -> list[Path]:
    return [p for p in _files("cqk_megatron/training/engines") if _is_engine_spec(_module_name(p))]


def test_the_engines_torch_free_half_imports_no_torch_and_no_engine_class():
    files = _engine_spec_files()
    assert {p.name for p in files} >= {"__init__.py", "registry.py", "spec.py"}, files
    engine_classes = [
        _module_name(p) for p in _files("cqk_megatron/training/engines") if p not in files
    ]
    forbidden = (*ENGINES, *engine_classes)
    assert _violations(files, forbidden, "config.validate runs it without torch") == []


def test_the_math_imports_nothing_of_the_package_or_megatron():
    # it is copied verbatim into every Hugging Face export, where only torch exists
    math = [REPO / "cqk_megatron/variants/plain_math.py"]
    found = _violations(
        math, ("cqk_megatron", "launch", "megatron", "deepspeed", "transformers"), "the math"
    )
    assert found == []


# Reading the machine needs torch: validate() asks it only for a check that depends on it
# (tests/test_config.py::test_validate_reads_the_machine_only_where_a_check_needs_it).
MACHINE_PROBE = ("cqk_megatron/config/checks.py", "_cuda_available")


def _enclosing_function(path: Path, line: int) -> str | None:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.lineno <= line <= node.end_lineno:
            return node.name
    return None


def test_config_and_run_import_no_torch():
    # the launcher and the analysis read configs and run folders on a login node
    files = _files("cqk_megatron/config") + _files("cqk_megatron/run")
    found = [
        f"{path.relative_to(REPO)}:{line} imports {module}: config/ and run/ are torch-free"
        for path in files
        for line, module in _imports(path)
        if _is(module, *ENGINES)
        and (str(path.relative_to(REPO)), _enclosing_function(path, line)) != MACHINE_PROBE
    ]
    assert found == []


def test_the_model_imports_no_training_launch_or_analysis():
    forbidden = ("cqk_megatron.training", "launch", "cqk_megatron.analysis", "cqk_megatron.cli")
    assert _violations(_files("cqk_megatron/model"), forbidden, "model/ is below them") == []


def test_analysis_reads_files_and_never_the_engine():
    # the one parameter count (model/params.py) is torch-free arithmetic: analysis may count
    forbidden = ENGINES[1:] + (
        "cqk_megatron.training",
        "cqk_megatron.model.gpt",
        "cqk_megatron.model.specs",
        "cqk_megatron.model.attention",
        "cqk_megatron.parallel",
    )
    assert _violations(_files("cqk_megatron/analysis"), forbidden, "analysis reads files") == []


def _command_line_modules() -> set[str]:
    """Modules that parse a command line: the console scripts' targets (setup.py), the
    ``cqk`` dispatcher and everything under ``cqk_megatron/cli/``."""
    setup = (REPO / "setup.py").read_text()
    targets = set(re.findall(r'"[\w-]+\s*=\s*([\w.]+):\w+"', setup))
    targets |= {"cqk_megatron.__main__", "cqk_megatron.cli", "launch.submit"}
    return targets


def test_training_imports_no_command_line_module():
    cli = tuple(sorted(_command_line_modules()))
    found = _violations(_files("cqk_megatron/training"), cli, "a command line imports training")
    assert found == []


def _package_graph() -> dict[str, dict[str, str]]:
    """unit -> {imported unit: the first place it is imported}."""
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for path in _sources():
        me = _unit(_module_name(path))
        for line, module in _imports(path):
            if module.split(".")[0] in OURS and _unit(module) != me:
                graph[me].setdefault(_unit(module), f"{path.relative_to(REPO)}:{line}")
    return graph


def _cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Each strongly connected group of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def _module_graph() -> dict[str, dict[str, str]]:
    """module -> {imported module of ours: the first place it is imported}, for the
    imports that run (those under ``if TYPE_CHECKING:`` do not)."""
    sources = _sources()
    ours = {_module_name(path) for path in sources}
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for path in sources:
        me = _module_name(path)
        for line, module in _imports(path, with_type_checking=False):
            if module in ours and module != me:
                graph[me].setdefault(module, f"{path.relative_to(REPO)}:{line}")
    return graph


def test_no_two_modules_import_each_other():
    graph = _module_graph()
    found = []
    for group in _cycles(graph):
        edges = [f"{a} -> {b} ({graph[a][b]})" for a in group for b in group if b in graph[a]]
        found.append("a cycle: " + "; ".join(edges))
    assert found == [], "\n".join(found)


def test_no_library_module_runs_as_a_script():
    """``python -m`` entry points live in ``cli/`` (and ``__main__.py`` files that only
    dispatch); ``cqk_megatron/train.py`` is the command that torchrun and srun start, in
    the command-line layer. A module of any other package is a library."""
    found = []
    for path in _files("cqk_megatron"):
        relative = path.relative_to(REPO)
        if relative.parts[1] == "cli" or path.name == "__main__.py" or relative.name == "train.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                found.append(f"{relative}:{node.lineno}")
    assert found == [], "library modules with a __main__ block: " + ", ".join(found)


def test_no_two_packages_depend_on_each_other():
    graph = _package_graph()
    found = []
    for group in _cycles(graph):
        edges = [f"{a} -> {b} ({graph[a][b]})" for a in group for b in group if b in graph[a]]
        found.append("a cycle: " + "; ".join(edges))
    assert found == [], "\n".join(found)


# docs/architecture.md's layers, lowest first: a package imports its own layer or lower ones
LAYERS = [
    ["cqk_megatron.variants", "cqk_megatron.errors", ARGS, "cqk_megatron.compat"],
    ["cqk_megatron.config", "cqk_megatron.run", ENGINE_SPECS],
    ["cqk_megatron.data"],
    ["cqk_megatron.model", "cqk_megatron.parallel", "cqk_megatron.perf"],
    ["cqk_megatron.training"],
    ["cqk_megatron.bench", "cqk_megatron.planner", "cqk_megatron.convert", "cqk_megatron.eval"],
    ["launch", "cqk_megatron.analysis", "cqk_megatron.repro", "data_tools"],
    ["cqk_megatron.cli", "cqk_megatron.__main__", "cqk_megatron.train"],
]


def test_no_package_imports_a_higher_layer():
    layer = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    graph = _package_graph()
    assert set(graph) <= set(layer), f"give these a layer: {sorted(set(graph) - set(layer))}"
    found = [
        f"{a} (layer {layer[a]}) imports {b} (layer {layer[b]}) at {where}"
        for a, imported in sorted(graph.items())
        for b, where in sorted(imported.items())
        if layer.get(b, -1) > layer[a]
    ]
    assert found == [], "\n".join(found)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": "x"}, "b": {"c": "y"}, "c": {"a": "z"}, "d": {"a": "w"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_the_package_has_at_most_five_files_at_its_top():
    top = sorted(p.name for p in (REPO / "cqk_megatron").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_FILES, top


def test_no_function_in_the_package_is_longer_than_80_lines():
    long = []
    for path in sorted((REPO / "cqk_megatron").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines}")
    assert long == [], "\n".join(long)
