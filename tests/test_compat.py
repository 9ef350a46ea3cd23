"""Every patch of torch, Megatron-Core and DeepSpeed lives in ``cqk_megatron/compat/``
and is listed in ``compat.PATCHES``: these tests read that list against the installed
libraries (each target exists; each patched function takes the parameters the patch was
written against, so a new pin fails here and names the patch to read again), against the
code that makes the patches, and against the rest of the package (no module outside
``compat/`` sets an attribute of those libraries)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from cqk_megatron.compat import PATCHES, Patch, cpu_bridge, save_writes

REPO = Path(__file__).resolve().parent.parent
LIBRARIES = ("torch", "megatron", "deepspeed")


def _resolve(target: str):
    module_name, _, attribute = target.partition(":")
    value = importlib.import_module(module_name)
    for part in attribute.split("."):
        value = getattr(value, part)
    # an installed CPU bridge wraps some functions and replaces others: the original is
    # the one patched
    if module_name == cpu_bridge._RNG_MODULE and attribute in cpu_bridge._RNG_ORIGINALS:
        return cpu_bridge._RNG_ORIGINALS[attribute]
    return getattr(value, "_cpu_bridge_original", value)


def _parameters(function) -> tuple[str, ...]:
    """Its parameter names; a builtin's from the call its documentation opens with."""
    try:
        return tuple(inspect.signature(function).parameters)
    except ValueError:
        call = next(line for line in (function.__doc__ or "").splitlines() if line.strip())
        inside = re.search(r"\((.*)\)", call).group(1)
        return tuple(p.split("=")[0].strip(" *") for p in inside.split(",") if p.strip())


def mismatches(patches) -> list[str]:
    found = []
    for patch in patches:
        if patch.parameters is None:
            continue
        have = _parameters(_resolve(patch.target))
        if have != patch.parameters:
            found.append(
                f"{patch.target} takes {have}; compat/{patch.where}.py was written for "
                f"{patch.parameters} ({patch.written_for}): read the patch again"
            )
    return found


def test_the_patches_are_listed_with_why_version_and_what_retires_them():
    table = "\n".join(f"{p.target}: {p.how} [{p.written_for}]" for p in PATCHES)
    print(table)
    for patch in PATCHES:
        assert patch.why and patch.retire_when and patch.written_for, patch
        assert (REPO / "cqk_megatron/compat" / f"{patch.where}.py").is_file(), patch


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.target)
def test_every_patched_target_exists_in_the_installed_libraries(patch: Patch):
    _resolve(patch.target)


def test_each_patched_function_takes_the_parameters_it_was_written_for():
    assert mismatches(PATCHES) == []


def test_a_changed_signature_is_reported_with_the_patch_to_read_again():
    changed = Patch("torch:save", "", "", "torch 2.13", "", "save_writes", ("obj", "f"))
    (message,) = mismatches([changed])
    assert message.startswith("torch:save takes ('obj', 'f', 'pickle_module'")
    assert "compat/save_writes.py was written for ('obj', 'f') (torch 2.13)" in message


def _listed(where: str) -> set[str]:
    return {p.target for p in PATCHES if p.where == where}


def test_the_list_holds_every_patch_the_code_makes():
    views = {f"{m}:torch" for m in (*cpu_bridge._PATCHED_MODULES, cpu_bridge._RNG_MODULE)}
    views |= {f"{cpu_bridge._RNG_MODULE}:{name}" for name in cpu_bridge._RNG_BRIDGE}
    wrapped = {
        f"{owner.__module__}:{owner.__qualname__}.{name}"
        if inspect.isclass(owner)
        else f"{owner.__name__}:{name}"
        for owner, name, _ in cpu_bridge._tensor_method_users()
    }
    assert views | wrapped <= _listed("cpu_bridge")
    import deepspeed.runtime.engine  # noqa: F401  (so that its copyfile is among the writes)

    writes = {f"{owner.__name__}:{name}" for owner, name, _ in save_writes.write_functions()}
    assert writes == _listed("save_writes")


def _library_names(tree: ast.Module) -> set[str]:
    """Names a module binds to torch, Megatron-Core or DeepSpeed (or a part of them)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in LIBRARIES:
                names |= {alias.asname or alias.name for alias in node.names}
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


# Settings the libraries document as settable (not patches of their code)
SETTINGS = ("torch.backends.", "torch._dynamo.config.", "torch._inductor.config.")


def test_no_module_outside_compat_sets_an_attribute_of_the_libraries():
    found = []
    for path in sorted((REPO / "cqk_megatron").rglob("*.py")):
        if "compat" in path.parts or "hf_remote" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        names = _library_names(tree)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                targets = [t for t in targets if isinstance(t, ast.Attribute)]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
                targets = node.args[:1]
            for target in targets:
                text = ast.unparse(target)
                if _root(target) in names and not text.startswith(SETTINGS):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {text}")
    assert found == [], "patches belong in cqk_megatron/compat/:\n" + "\n".join(found)
