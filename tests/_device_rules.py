"""A static check for the bug class that stops a first GPU run at step 1 (tests only).

On a CPU run every tensor is on the CPU, so a tensor made without ``device=`` or a batch
never moved to the GPU runs fine here and fails on the first GPU node. These rules read
the source (``ast``) of the modules that drive training (``cqk_megatron/training/``:
loop, engines, preemption, checkpoint, sampler, collectives) and evaluation
(``cqk_megatron/eval/``):

1. ``factory``: every tensor factory (``torch.zeros``, ``torch.tensor``, ...) names its
   device (``device=device()``, or ``device="cpu"`` where a host tensor is meant).
2. ``collective``: no ``torch.distributed`` function that communicates is called outside
   ``training/collectives.py``, whichever way ``torch.distributed`` was imported.
3. ``placement``: tensors move only through ``cqk_megatron.parallel.device.to_device``: no
   ``.cuda()``, no ``.to(<device>)`` other than ``.to("cpu")``; batches are collated only in
   ``training/sampler.py``, whose ``fetch`` returns ``to_device(...)``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from cqk_megatron.training.collectives import COMMUNICATING

FACTORIES = frozenset(
    {
        "arange",
        "as_tensor",
        "empty",
        "empty_strided",
        "eye",
        "full",
        "linspace",
        "logspace",
        "ones",
        "rand",
        "randint",
        "randn",
        "randperm",
        "tensor",
        "zeros",
    }
)
SCOPE = ("cqk_megatron/training", "cqk_megatron/eval")
OWNER = "cqk_megatron/training/collectives.py"
SAMPLER = "cqk_megatron/training/sampler.py"
DTYPE_NAMES = frozenset(
    {"float16", "float32", "float64", "bfloat16", "half", "float", "double", "int8", "int16"}
    | {"int32", "int64", "long", "int", "uint8", "bool", "complex64", "complex128"}
)


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    rule: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.text}"


def scoped_files(root: Path) -> list[Path]:
    return sorted(p for folder in SCOPE for p in (root / folder).rglob("*.py"))


def scan(root: Path) -> list[Violation]:
    """Every violation in the scoped modules under repository ``root``."""
    found = []
    for path in scoped_files(root):
        relative = path.relative_to(root).as_posix()
        found += scan_source(path.read_text(), relative)
    return found


def scan_source(source: str, relative: str) -> list[Violation]:
    """The violations in one module's ``source`` (``relative``: its path in the repo)."""
    tree = ast.parse(source)
    checker = _Checker(relative)
    checker.visit(tree)
    if relative == SAMPLER:
        checker.check_fetch(tree)
    return checker.found


class _Checker(ast.NodeVisitor):
    def __init__(self, relative: str) -> None:
        self.relative = relative
        self.found: list[Violation] = []
        self.torch_names = {"torch"}  # names bound to the torch module
        self.dist_names: set[str] = set()  # names bound to torch.distributed
        self.direct: dict[str, str] = {}  # local name -> torch.distributed function

    def flag(self, node: ast.AST, rule: str, text: str) -> None:
        self.found.append(Violation(self.relative, node.lineno, rule, text))

    # -- imports -----------------------------------------------------------------------

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "torch":
                self.torch_names.add(alias.asname or "torch")
            elif alias.name == "torch.distributed" and alias.asname:
                self.dist_names.add(alias.asname)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            local = alias.asname or alias.name
            if node.module == "torch" and alias.name == "distributed":
                self.dist_names.add(local)
            elif node.module == "torch.distributed" and alias.name in COMMUNICATING:
                self.direct[local] = alias.name
        self.generic_visit(node)

    # -- calls -------------------------------------------------------------------------

    def _is_dist(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.dist_names
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id in self.torch_names
        )

    def visit_Call(self, node: ast.Call) -> None:
        function = node.func
        if isinstance(function, ast.Attribute):
            owner = function.value
            if (
                isinstance(owner, ast.Name)
                and owner.id in self.torch_names
                and function.attr in FACTORIES
                and not any(k.arg == "device" for k in node.keywords)
            ):
                self.flag(node, "factory", f"torch.{function.attr}(...) without device=")
            if self._is_dist(owner) and function.attr in COMMUNICATING:
                self._collective(node, function.attr)
            if function.attr == "cuda":
                self.flag(node, "placement", ".cuda(): move tensors with to_device")
            if function.attr == "to" and self._names_a_device(node):
                self.flag(node, "placement", ".to(<device>): move tensors with to_device")
        elif isinstance(function, ast.Name):
            if function.id in self.direct:
                self._collective(node, self.direct[function.id])
            if function.id == "default_collate" and self.relative != SAMPLER:
                self.flag(node, "placement", "default_collate outside training/sampler.py")
        self.generic_visit(node)

    def _collective(self, node: ast.Call, name: str) -> None:
        if self.relative != OWNER:
            self.flag(node, "collective", f"torch.distributed.{name} outside {OWNER}")

    def _names_a_device(self, node: ast.Call) -> bool:
        for keyword in node.keywords:
            if keyword.arg == "device" and not _is_cpu(keyword.value):
                return True
        return any(not (_is_cpu(arg) or self._is_dtype(arg)) for arg in node.args)

    def _is_dtype(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute):
            if node.attr == "dtype":
                return True
            return (
                isinstance(node.value, ast.Name)
                and node.value.id in self.torch_names
                and node.attr in DTYPE_NAMES
            )
        return isinstance(node, ast.Name) and "dtype" in node.id

    def check_fetch(self, tree: ast.Module) -> None:
        """``sampler.fetch`` returns ``to_device(...)``: the one door batches go through."""
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "fetch":
                returns = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
                placed = all(
                    isinstance(r.value, ast.Call)
                    and isinstance(r.value.func, ast.Name)
                    and r.value.func.id == "to_device"
                    for r in returns
                )
                if not returns or not placed:
                    self.flag(node, "placement", "sampler.fetch must return to_device(...)")
                return
        self.flag(tree.body[0] if tree.body else tree, "placement", "sampler.fetch is missing")


def _is_cpu(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == "cpu"
