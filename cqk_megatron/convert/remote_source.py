"""The source of the attention variant's classes that an exported folder ships.

An export to the custom architecture carries ``variants/plain_math.py`` verbatim, as
``coupling.py`` (``EXPORTED_MATH_FILE``: the math of every variant that ships with
cqk-megatron), and one generated file, ``cqk_variant.py``, which
``modeling_cqk.py`` imports: its ``VARIANT_CLASSES`` maps class names to the classes
registered in ``cqk_megatron.variants`` (couplings' modules, scorings' math), among them
those that ``config.json`` records for the exported variant (``coupling_class``,
``scoring_class``, and ``coupling_source``: the shipped file that defines the coupling).

A class of ``plain_math.py`` is imported from the shipped copy. A class registered from
anywhere else (a researcher's module, a test) has its own source copied into
``cqk_variant.py``, so the folder runs without that module and without this package. Its
free names must then be ones the generated file provides exactly as its home module sees
them: ``math``, ``torch``, ``F`` (``torch.nn.functional``), ``nn``, builtins, and the
names of ``plain_math.py``; anything else (a helper function beside the class) is refused at
export time, naming it.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import math
import sys
import textwrap

import torch
import torch.nn.functional as F
from torch import nn

from cqk_megatron.config import RunConfig
from cqk_megatron.convert.errors import ConversionError
from cqk_megatron.variants import COUPLINGS, SCORINGS, coupling, plain_math, scoring

# plain_math.py's name in an exported folder: modeling_cqk.py and every export made so far
# import it as ``.coupling``, so the name stays
EXPORTED_MATH_FILE = "coupling.py"
VARIANT_FILE = "cqk_variant.py"
# What the generated file's header binds, and to which objects
HEADER_NAMES = {"math": math, "torch": torch, "F": F, "nn": nn}
HEADER = (
    "from __future__ import annotations\n\n"
    "import math\n\n"
    "import torch\n"
    "import torch.nn.functional as F\n"
    "from torch import nn\n"
)


def variant_classes(config: RunConfig) -> tuple[type | None, type | None]:
    """(the coupling's module class, the scoring's math class) of ``config``; None each
    where there is none (no coupling, plain softmax scoring)."""
    a = config.attention
    return coupling(a.coupling).module_class(), scoring(a.scoring).math_class()


def is_math_class(cls: type) -> bool:
    """Whether ``cls`` is defined in ``plain_math.py`` (shipped verbatim)."""
    return getattr(plain_math, cls.__name__, None) is cls


def _annotation_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside annotations (not evaluated: the file has ``annotations``)."""
    roots: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            roots.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns:
            roots.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
    return {id(n) for root in roots for n in ast.walk(root)}


def free_names(source: str) -> set[str]:
    """Names that ``source`` reads without binding them (nor being builtins), annotations
    left out. Coarse on purpose: a name bound anywhere in the source counts as bound."""
    tree = ast.parse(source)
    in_annotation = _annotation_nodes(tree)
    loaded, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and id(node) not in in_annotation:
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
    return loaded - bound - set(dir(builtins))


def _class_source(cls: type) -> tuple[str, set[str]]:
    """``cls``'s source and the names of ``plain_math.py`` it needs; refused, naming the
    problem, where the generated file could not define it as its home module does."""
    where = f"{cls.__module__}.{cls.__qualname__}"
    if "." in cls.__qualname__:
        raise ConversionError(
            f"{where} is not defined at the top level of its module, so its source cannot "
            "be shipped with the export; define the class at module level"
        )
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError) as error:
        raise ConversionError(f"the source of {where} cannot be read ({error})") from error
    home = vars(sys.modules[cls.__module__])
    needed = set()
    for name in sorted(free_names(source)):
        value = home.get(name)
        if name in HEADER_NAMES and value is HEADER_NAMES[name]:
            continue
        if value is not None and getattr(plain_math, name, None) is value:
            needed.add(name)
            continue
        raise ConversionError(
            f"{where} uses {name!r} from its module {cls.__module__}, which the export cannot "
            f"ship: its source is copied into {VARIANT_FILE} beside a verbatim "
            f"{EXPORTED_MATH_FILE} (plain_math.py), where only {sorted(HEADER_NAMES)}, builtins "
            f"and {EXPORTED_MATH_FILE}'s names exist; "
            "move it into the class or use those"
        )
    return source, needed


def _registered_math_classes() -> set[str]:
    """Every registered coupling's and scoring's class that ``plain_math.py`` defines."""
    classes = [v.module_class() for v in COUPLINGS.values()]
    classes += [v.math_class() for v in SCORINGS.values()]
    return {cls.__name__ for cls in classes if cls is not None and is_math_class(cls)}


def variant_source(config: RunConfig) -> str:
    """The text of ``cqk_variant.py`` for ``config``'s variant (refused as above).

    It names every registered class of ``plain_math.py``, not only the variant's, so that it
    is the same file for every export of those: transformers re-runs ``modeling_cqk.py``
    for another folder of the same name in one process, but keeps the ``cqk_variant`` it
    imported first. Only a variant with a class from elsewhere makes it differ.
    """
    from_math = _registered_math_classes()
    copied: list[str] = []
    names = set(from_math)
    for cls in variant_classes(config):
        if cls is not None and not is_math_class(cls):
            source, needed = _class_source(cls)
            from_math |= needed
            copied.append(source)
            names.add(cls.__name__)
    parts = [
        '"""The classes that config.json names (coupling_class, scoring_class): those of '
        "coupling.py\n(cqk-megatron's plain_math.py), and the source of any other that the "
        "exported variant uses.\n\n"
        'Written by cqk-megatron\'s exporter."""\n\n' + HEADER
    ]
    parts.append(f"\nfrom .coupling import {', '.join(sorted(from_math))}\n")
    parts.extend(f"\n\n{source}" for source in copied)
    table = "".join(f'    "{name}": {name},\n' for name in sorted(names))
    parts.append(f"\n\nVARIANT_CLASSES = {{\n{table}}}\n")
    return "".join(parts)


def scoring_options(config: RunConfig) -> dict:
    """The exported scoring's constructor keywords: its fixed ones (the form the exported
    model runs) and those taken from the config (``attention.differential_norm``)."""
    variant = scoring(config.attention.scoring)
    return {**variant.export_options, **variant.constructor_options(config.attention)}


def export_fields(config: RunConfig) -> dict:
    """What ``config.json`` records of the variant's classes: their names, the file that
    defines the coupling, and the scoring's options in the exported model."""
    coupling_cls, scoring_cls = variant_classes(config)
    source = None
    if coupling_cls is not None:
        source = EXPORTED_MATH_FILE if is_math_class(coupling_cls) else VARIANT_FILE
    return {
        "coupling_class": None if coupling_cls is None else coupling_cls.__name__,
        "coupling_source": source,
        "scoring_class": None if scoring_cls is None else scoring_cls.__name__,
        "scoring_options": scoring_options(config),
    }
