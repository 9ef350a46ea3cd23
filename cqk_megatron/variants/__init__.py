"""Attention variants: every coupling and scoring as one registered object, and the named
presets of the two. See ``registry`` for the objects and ``builtin`` for those that ship.

Adding a coupling is one class (a ``coupling.QKCoupling``) and one ``register_coupling``
call in any module imported before the config is validated (README, "Adding a variant").
"""

from cqk_megatron.variants import builtin  # noqa: F401  (registers what ships)
from cqk_megatron.variants.options import (
    COUPLING_IMPLS,
    COUPLING_POSITIONS,
    DIFFERENTIAL_KERNEL_SETTINGS,
    DIFFERENTIAL_KERNELS,
    DIFFERENTIAL_NORMS,
    INTEGRATOR_STEPS,
)
from cqk_megatron.variants.registry import (
    ALIASES,
    COUPLINGS,
    SCORINGS,
    VARIANTS,
    ActivationTerm,
    AttentionCalls,
    CouplingCost,
    CouplingMemory,
    CouplingVariant,
    Heads,
    ScoringVariant,
    UnknownVariantError,
    build_coupling,
    check_config,
    coupling,
    coupling_for_class,
    pair,
    preset_of,
    register_coupling,
    register_scoring,
    register_variant,
    registered,
    scoring,
    unknown_message,
    unknown_names,
    variant_name,
)

__all__ = [
    "ALIASES",
    "COUPLINGS",
    "COUPLING_IMPLS",
    "COUPLING_POSITIONS",
    "DIFFERENTIAL_KERNEL_SETTINGS",
    "DIFFERENTIAL_KERNELS",
    "DIFFERENTIAL_NORMS",
    "INTEGRATOR_STEPS",
    "SCORINGS",
    "VARIANTS",
    "ActivationTerm",
    "AttentionCalls",
    "CouplingCost",
    "CouplingMemory",
    "CouplingVariant",
    "Heads",
    "ScoringVariant",
    "UnknownVariantError",
    "build_coupling",
    "check_config",
    "coupling",
    "coupling_for_class",
    "pair",
    "preset_of",
    "register_coupling",
    "register_scoring",
    "register_variant",
    "registered",
    "scoring",
    "unknown_message",
    "unknown_names",
    "variant_name",
]
