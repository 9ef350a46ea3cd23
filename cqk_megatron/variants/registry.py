"""The registry of attention variants: each coupling and each scoring is one object.

A ``CouplingVariant`` (or ``ScoringVariant``) owns everything cqk-megatron knows about one
coupling (or scoring), declared, not branched on: its module class, the options it takes
from ``AttentionConfig``, its fused form, its config checks, its FLOPs and activation terms,
and the class an exported Hugging Face model finds it under (the class's own name). Config,
specs, perf, convert and the exported remote code take their name lists and formulas from
here; parameter counts come from instantiating the module.

Modules are named as Megatron-Core's ``ModuleSpec`` names them: the class itself, or a
``(module path, name)`` pair imported on first use. That keeps this file free of torch, so
``config.validate`` (run on login nodes, where importing torch can take 25 s) reads the
registry without it. The anchors: Megatron-Core's ``ModuleSpec``/``build_module`` (a
layer is declared, not branched) and torchtitan's ``TrainSpec``/``Configurable`` (a
component's config, build and adapters live together, registered once by name).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar, cast

ModuleRef = type | tuple[str, str]  # a class, or (module path, class name) as in ModuleSpec
PLAIN_MATH_SOURCE = Path(__file__).resolve().parent / "plain_math.py"
ADDING = "register one with cqk_megatron.variants (docs/variants.md, Adding a variant)"


class UnknownVariantError(ValueError):
    """A coupling, scoring or variant name that nothing registered."""


def resolve(ref: Any) -> Any:
    """A class or function from a ``ModuleRef`` (or the object itself)."""
    if isinstance(ref, tuple):
        path, name = ref
        return getattr(importlib.import_module(path), name)
    return ref


@cache
def math_constant(name: str) -> Any:
    """A literal constant of ``plain_math.py``, read from its source rather than imported.

    The math checks its own arguments (its module is the one the exported models run), and
    the config checks must give the same bounds without importing torch: the constant lives
    in ``plain_math.py`` once, and this reads it.
    """
    for node in ast.parse(PLAIN_MATH_SOURCE.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return ast.literal_eval(node.value)
    raise LookupError(f"{PLAIN_MATH_SOURCE} defines no literal constant {name}")


# --- what the perf terms are functions of ---------------------------------------------------


@dataclass(frozen=True)
class Heads:
    """One layer's attention heads, before any tensor-parallel split."""

    head_dim: int
    q_heads: int
    kv_heads: int

    @classmethod
    def of(cls, model: Any) -> Heads:
        """From a ``ModelConfig``."""
        return cls(model.head_dim, model.num_attention_heads, model.kv_heads)

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


@dataclass(frozen=True)
class CouplingCost:
    """Forward work per token of one layer's coupling, as its running form does it."""

    matmul: float  # FLOPs of matrix multiplications (2 per multiply-add): in the totals
    elementwise: float  # adds, multiplies, exp/tanh of the updates: reported, not counted


@dataclass(frozen=True)
class CouplingMemory:
    """What one layer's coupling keeps for the backward, per token."""

    elements: float  # in the training precision, split over TP with the heads
    # keeps a view of its pre-RoPE q or k, hence all of the QKV projection's output
    keeps_qkv_view: bool = False


@dataclass
class ActivationTerm:
    """Elements per token kept for the backward by one layer, before any TP split.

    ``sharded``: split over TP always (heads, FFN width); otherwise only with sequence
    parallelism. ``dtype``: ``act`` (the training precision) or ``fp32`` (log-sum-exp,
    norm statistics, upcasts). ``group``: which recomputation drops it: ``core_attention``
    (selective recompute), ``coupling`` (``attention.recompute_coupling``), or ``layer``
    (full recompute only; a core attention's inputs, which its checkpoint keeps).
    """

    elements: float
    sharded: bool = True
    dtype: str = "act"
    group: str = "layer"  # layer | core_attention | coupling


@dataclass(frozen=True)
class AttentionCalls:
    """The softmax attention calls a scoring makes per layer (FLOPs and SDPA's memory)."""

    calls: int  # attention calls, each over every one of its query heads
    q_heads: int
    kv_heads: int
    value_width: int  # elements per value head


Checks = Callable[[Any], Iterable[str]]  # RunConfig -> messages naming the field and the fix


def _no_checks(config: Any) -> Iterable[str]:
    return ()


# --- the two kinds of registered object -----------------------------------------------------


@dataclass(frozen=True)
class CouplingVariant:
    """A coupling of (q, k) before scoring.

    ``module``: a ``coupling.QKCoupling`` subclass built as ``module(head_dim=..., **options)``
    (None: no coupling). ``options``: constructor keyword -> ``AttentionConfig`` field
    (``coupling_hidden`` of None means ``head_dim``). ``fused``: ``(coupling, q, k) ->
    (function, tensors, options)`` computing the same function faster (see
    ``attention/fast_coupling.py``); None: the module runs as it is, and
    ``attention.coupling_impl=compiled`` is refused. ``checks``: config rules of this
    coupling. ``flops`` and ``memory``: ``(Heads, options) -> CouplingCost`` /
    ``CouplingMemory`` for the FLOPs and memory estimates, which refuse a coupling without
    them. Parameters are never declared: they are counted on the built module.
    """

    name: str
    module: ModuleRef | None
    options: Mapping[str, str] = field(default_factory=dict)
    fused: ModuleRef | Callable[..., Any] | None = None
    checks: Checks = _no_checks
    flops: Callable[[Heads, Mapping[str, Any]], CouplingCost] | None = None
    memory: Callable[[Heads, Mapping[str, Any]], CouplingMemory] | None = None

    kind = "coupling"

    def module_class(self) -> type | None:
        return cast("type | None", resolve(self.module))

    def fused_form(self) -> Callable[..., Any] | None:
        return cast("Callable[..., Any] | None", resolve(self.fused))

    def constructor_options(self, attention: Any, head_dim: int) -> dict[str, Any]:
        """The module's keyword arguments (besides ``head_dim``) for an ``AttentionConfig``."""
        options = {}
        for keyword, name in self.options.items():
            value = getattr(attention, name)
            options[keyword] = head_dim if value is None and name == "coupling_hidden" else value
        return options

    def attention_fields(self, options: Mapping[str, Any], source: str) -> dict[str, Any]:
        """The ``AttentionConfig`` fields that ``options`` (constructor keywords) came from."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ValueError(
                f"{source}: coupling {self.name!r} takes options {sorted(self.options)}, not "
                f"{unknown}"
            )
        return {self.options[keyword]: value for keyword, value in options.items()}

    def build(self, head_dim: int, **options: Any) -> Any:
        """The module (None for no coupling)."""
        cls = self.module_class()
        return None if cls is None else cls(head_dim=head_dim, **options)

    def parameters(self, head_dim: int, options: Mapping[str, Any]) -> int:
        """Parameters of one layer's coupling, counted on the module built on the meta device."""
        cls = self.module_class()
        if cls is None:
            return 0
        return _parameters_of_class(cls, (), (("head_dim", head_dim), *sorted(options.items())))

    def cost(self, heads: Heads, options: Mapping[str, Any]) -> CouplingCost:
        return cast(
            CouplingCost, _declared(self, "flops", "FLOPs and MFU estimates")(heads, options)
        )

    def kept(self, heads: Heads, options: Mapping[str, Any]) -> CouplingMemory:
        hook = _declared(self, "memory", "activation-memory estimates")
        return cast(CouplingMemory, hook(heads, options))


@dataclass(frozen=True)
class ScoringVariant:
    """A scoring rule: how (q, k, v) become the attention output.

    ``core_attention``: the Megatron core attention class (its ``spec_params(attention,
    transformer_impl)`` gives its options). ``math``: the module of its own parameters and rule in
    ``plain_math.py`` style, which the core attention holds as ``math_attribute`` and the
    exported model builds as ``math(head_dim, layer_index=..., eps=..., **export_options,
    **options)`` and calls as ``math(q, k, v, attend)``; None: plain softmax attention.
    ``options``: ``math``'s constructor keyword -> the ``AttentionConfig`` field it comes
    from (a field that only this scoring reads; other scorings refuse a value of it other
    than its default). ``calls`` and
    ``memory`` (extra ``ActivationTerm``s by name) serve the FLOPs and memory estimates;
    ``keeps_value_view``: whether its attention keeps a view of the QKV output (the value).
    """

    name: str
    core_attention: ModuleRef
    math: ModuleRef | None = None
    math_attribute: str | None = None
    export_options: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, str] = field(default_factory=dict)
    checks: Checks = _no_checks
    calls: Callable[[Heads], AttentionCalls] | None = None
    memory: Callable[[Heads], Mapping[str, ActivationTerm]] | None = None
    keeps_value_view: bool = True

    kind = "scoring"

    def core_attention_class(self) -> type:
        return cast(type, resolve(self.core_attention))

    def math_class(self) -> type | None:
        return cast("type | None", resolve(self.math))

    def constructor_options(self, attention: Any) -> dict[str, Any]:
        """``math``'s keyword arguments from an ``AttentionConfig`` (its ``options``)."""
        return {keyword: getattr(attention, name) for keyword, name in self.options.items()}

    def attention_fields(self, options: Mapping[str, Any], source: str) -> dict[str, Any]:
        """The ``AttentionConfig`` fields that ``options`` (an exported model's scoring
        options: ``export_options`` and ``options``' keywords) came from."""
        unknown = sorted(set(options) - set(self.options) - set(self.export_options))
        if unknown:
            raise ValueError(
                f"{source}: scoring {self.name!r} takes options {sorted(self.options)}, not "
                f"{unknown}"
            )
        fields = self.options.items()
        return {name: options[keyword] for keyword, name in fields if keyword in options}

    def parameters(self, head_dim: int, options: Mapping[str, Any] | None = None) -> int:
        """Parameters of one layer's scoring, counted on its math module (meta device)."""
        cls = self.math_class()
        if cls is None:
            return 0
        kwargs = (("layer_index", 0), *sorted((options or {}).items()))
        return _parameters_of_class(cls, (head_dim,), kwargs)

    def attention_calls(self, heads: Heads) -> AttentionCalls:
        return cast(AttentionCalls, _declared(self, "calls", "FLOPs and memory estimates")(heads))

    def activation_terms(self, heads: Heads) -> Mapping[str, ActivationTerm]:
        hook = _declared(self, "memory", "activation-memory estimates")
        return cast("Mapping[str, ActivationTerm]", hook(heads))


Variant = CouplingVariant | ScoringVariant
_V = TypeVar("_V", CouplingVariant, ScoringVariant)


def _declared(variant: Variant, term: str, needed_by: str) -> Callable[..., Any]:
    hook = getattr(variant, term)
    if hook is None:
        raise NotImplementedError(
            f"{variant.kind} {variant.name!r} declares no {term!r} term "
            f"({type(variant).__name__}.{term}), which the {needed_by} need; add it to its "
            "registration"
        )
    return cast("Callable[..., Any]", hook)


@lru_cache(maxsize=256)
def _parameters_of_class(cls: type, args: tuple[Any, ...], kwargs: tuple[Any, ...]) -> int:
    import torch  # only here: the registry itself stays importable without torch

    with torch.device("meta"):
        module = cls(*args, **dict(kwargs))
    return sum(p.numel() for p in module.parameters())


# --- the tables -----------------------------------------------------------------------------

_COUPLINGS: dict[str, CouplingVariant] = {}
_SCORINGS: dict[str, ScoringVariant] = {}
_VARIANTS: dict[str, tuple[str, str]] = {}
_ALIASES: dict[str, str] = {}
_BY_CLASS: dict[type, CouplingVariant | None] = {}

# Read-only live views: what is registered later (a researcher's module) shows up in them.
COUPLINGS: Mapping[str, CouplingVariant] = MappingProxyType(_COUPLINGS)
SCORINGS: Mapping[str, ScoringVariant] = MappingProxyType(_SCORINGS)
# Named variants: presets of the two orthogonal choices (coupling, scoring).
VARIANTS: Mapping[str, tuple[str, str]] = MappingProxyType(_VARIANTS)
# Other names people type for a preset (the papers' integrator names, short forms).
ALIASES: Mapping[str, str] = MappingProxyType(_ALIASES)


def _check_name(name: str, what: str) -> None:
    # '+' joins a pair into a variant name, '@' starts cqk bench's tags
    if not (isinstance(name, str) and name and name.replace("_", "a").isalnum()):
        raise ValueError(f"{what} name {name!r}: use letters, digits and '_' only")


def _register(table: dict[str, _V], variant: _V) -> _V:
    _check_name(variant.name, variant.kind)
    if variant.name in table and table[variant.name] is not variant:
        raise ValueError(f"{variant.kind} {variant.name!r} is registered already")
    table[variant.name] = variant
    _BY_CLASS.clear()
    return variant


def register_coupling(variant: CouplingVariant) -> CouplingVariant:
    """Make ``attention.coupling=<variant.name>`` mean ``variant`` everywhere."""
    return _register(_COUPLINGS, variant)


def register_scoring(variant: ScoringVariant) -> ScoringVariant:
    """Make ``attention.scoring=<variant.name>`` mean ``variant`` everywhere."""
    return _register(_SCORINGS, variant)


def register_variant(
    name: str, coupling_name: str, scoring_name: str, aliases: Iterable[str] = ()
) -> None:
    """A named preset of (coupling, scoring), which ``include: variants/<name>.yaml``
    reads; ``aliases``: other names for it (``preset_of``)."""
    _check_name(name, "variant")
    coupling(coupling_name), scoring(scoring_name)  # refuse a preset of unknown parts
    if _VARIANTS.get(name, (coupling_name, scoring_name)) != (coupling_name, scoring_name):
        raise ValueError(f"variant {name!r} is registered already as {_VARIANTS[name]}")
    for alias in aliases:
        _check_name(alias, "variant alias")
        if alias in _VARIANTS or _ALIASES.get(alias, name) != name:
            raise ValueError(f"variant alias {alias!r} names another variant already")
    _VARIANTS[name] = (coupling_name, scoring_name)
    _ALIASES.update(dict.fromkeys(aliases, name))


def preset_of(text: str) -> str | None:
    """The preset that ``text`` names, as a person may type it (any case, ``-`` for
    ``_``, an alias); None if none does."""
    key = text.strip().lower().replace("-", "_") if isinstance(text, str) else ""
    key = _ALIASES.get(key, key)
    return key if key in _VARIANTS else None


@contextlib.contextmanager
def registered(variant: Variant) -> Iterator[Variant]:
    """Register ``variant`` for the ``with`` block only (tests, notebooks)."""
    if isinstance(variant, CouplingVariant):
        _register(_COUPLINGS, variant)
    else:
        _register(_SCORINGS, variant)
    try:
        yield variant
    finally:
        del (_COUPLINGS if isinstance(variant, CouplingVariant) else _SCORINGS)[variant.name]
        _BY_CLASS.clear()


def unknown_message(kind: str, name: Any, table: Mapping[str, Any]) -> str:
    """The one message for an unregistered name, wherever it is looked up."""
    return f"attention.{kind}={name!r} is unknown; choose one of {list(table)} (or {ADDING})"


def coupling(name: str) -> CouplingVariant:
    """The registered coupling ``name``; the one message if there is none."""
    try:
        return _COUPLINGS[name]
    except (KeyError, TypeError):
        raise UnknownVariantError(unknown_message("coupling", name, _COUPLINGS)) from None


def scoring(name: str) -> ScoringVariant:
    """The registered scoring ``name``; the one message if there is none."""
    try:
        return _SCORINGS[name]
    except (KeyError, TypeError):
        raise UnknownVariantError(unknown_message("scoring", name, _SCORINGS)) from None


def coupling_for_class(cls: type) -> CouplingVariant | None:
    """The coupling registered with exactly this module class (a subclass may change the
    math, so it is not taken for its parent)."""
    if cls not in _BY_CLASS:
        matches = [v for v in _COUPLINGS.values() if v.module is not None]
        _BY_CLASS[cls] = next((v for v in matches if v.module_class() is cls), None)
    return _BY_CLASS[cls]


def build_coupling(name: str, head_dim: int, **options: Any) -> Any:
    """The module of coupling ``name`` (None for ``none``) with its options."""
    return coupling(name).build(head_dim, **options)


def pair(variant: str) -> tuple[str, str]:
    """(coupling, scoring) of a variant: a preset name or ``coupling+scoring``."""
    if variant in _VARIANTS:
        return _VARIANTS[variant]
    parts = variant.split("+") if isinstance(variant, str) else []
    if len(parts) == 2 and parts[0] in _COUPLINGS and parts[1] in _SCORINGS:
        return parts[0], parts[1]
    raise UnknownVariantError(
        f"unknown variant {variant!r}; choose a preset of {list(_VARIANTS)} or "
        f"coupling+scoring with a coupling of {list(_COUPLINGS)} and a scoring of "
        f"{list(_SCORINGS)}"
    )


def variant_name(coupling_name: str, scoring_name: str) -> str:
    """The preset name of a (coupling, scoring) pair, or ``coupling+scoring``."""
    for name, choice in _VARIANTS.items():
        if choice == (coupling_name, scoring_name):
            return name
    return f"{coupling_name}+{scoring_name}"


def _chosen(config: Any) -> tuple[list[Variant], list[str]]:
    """The registered coupling and scoring that ``config.attention`` names, and the one
    message for each name that nothing registered."""
    chosen, unknown = [], []
    for kind, lookup in (("coupling", coupling), ("scoring", scoring)):
        try:
            chosen.append(lookup(getattr(config.attention, kind)))
        except UnknownVariantError as error:
            unknown.append(str(error))
    return chosen, unknown


def unknown_names(config: Any) -> list[str]:
    """The one message for each of ``attention.coupling``/``scoring`` not registered."""
    return _chosen(config)[1]


def check_config(config: Any) -> list[str]:
    """The chosen coupling's and scoring's config rules (a ``RunConfig`` whose sizes are
    already known to be positive), plus the rules every coupling shares; unregistered
    names are ``unknown_names``'s to report."""
    a = config.attention
    problems: list[str] = _options_of_other_scorings(config)
    for variant in _chosen(config)[0]:
        problems.extend(variant.checks(config))
        if (
            isinstance(variant, CouplingVariant)
            and variant.module is not None
            and variant.fused is None
            and a.coupling_impl == "compiled"
        ):
            problems.append(
                f"attention.coupling_impl=compiled: coupling {variant.name!r} has no fused "
                "form to compile (CouplingVariant.fused); use attention.coupling_impl=eager"
            )
    return problems


def _options_of_other_scorings(config: Any) -> list[str]:
    """One message for each field of another scoring's ``options`` set away from its
    default: the chosen scoring would ignore it, and a sweep that sets it means another."""
    a = config.attention
    chosen = _SCORINGS.get(a.scoring)
    mine = set(chosen.options.values()) if chosen is not None else set()
    defaults = type(a)()
    owners = {name: v.name for v in _SCORINGS.values() for name in v.options.values()}
    return [
        f"attention.{name}={getattr(a, name)!r} applies to scoring {owner!r} only, not "
        f"attention.scoring={a.scoring!r}; remove it or choose a {owner} variant"
        for name, owner in sorted(owners.items())
        if name not in mine and getattr(a, name) != getattr(defaults, name)
    ]
