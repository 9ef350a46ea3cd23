"""The couplings, scorings and named variants that ship with cqk-megatron.

The FLOPs and memory terms describe the form that runs in training: the fused form of
``attention/fast_coupling.py`` (eager or compiled: the same computation), where a group's
mean is taken before ``f``'s bias-free output layer, so that layer runs on the key heads
only; leapfrog steps share their kicks (``n + 1`` evaluations of ``f`` for ``n`` steps);
``dt`` is folded into the output layers' weights; ``k`` is broadcast over its query group,
never copied. Elementwise work counts each add, multiply, ``exp`` and ``tanh`` on a
token's tensors once (SiLU and what is done once per call, like ``softplus(dt)``, not).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from cqk_megatron.variants.options import DIFFERENTIAL_NORMS
from cqk_megatron.variants.registry import (
    ActivationTerm,
    AttentionCalls,
    CouplingCost,
    CouplingMemory,
    CouplingVariant,
    Heads,
    ScoringVariant,
    register_coupling,
    register_scoring,
    register_variant,
)

MATH = "cqk_megatron.variants.plain_math"
FAST = "cqk_megatron.model.attention.fast_coupling"
INTEGRATOR_OPTIONS = {"hidden": "coupling_hidden", "steps": "steps", "dt_init": "dt_init"}
Options = Mapping[str, Any]


def _mlp_flops(rows: int, in_dim: int, hidden: int, out_dim: int) -> float:
    """A two-layer MLP ``in -> hidden -> out`` on ``rows`` vectors (2 FLOPs a multiply-add)."""
    return 2.0 * rows * (in_dim * hidden + hidden * out_dim)


def _kick_flops(h: Heads, hidden: int) -> float:
    """``group_mean(f(q))``: the first layer on the query heads, the second on the key heads."""
    return 2.0 * hidden * h.head_dim * (h.q_heads + h.kv_heads)


def _grouped(h: Heads, width: int) -> float:
    """A mean over each query group of a ``width``-wide query-head tensor (none without GQA)."""
    return h.q_heads * width if h.group > 1 else 0.0


# --- none -----------------------------------------------------------------------------------


def _no_cost(h: Heads, o: Options) -> CouplingCost:
    return CouplingCost(0.0, 0.0)


def _nothing_kept(h: Heads, o: Options) -> CouplingMemory:
    return CouplingMemory(0.0)


# --- the integrators: Euler, leapfrog, MLP-only ----------------------------------------------


def _kick_memory(h: Heads, hidden: int) -> float:
    """One kick keeps fc1's output on the query heads and the group-meaned SiLU output on
    the key heads (fc2's input); with ``dt`` folded into fc2 the kick itself is not kept."""
    return h.q_heads * hidden + h.kv_heads * hidden


def _step_output(h: Heads) -> float:
    return (h.q_heads + h.kv_heads) * h.head_dim  # a step's q, k: the next step's inputs


def _euler_cost(h: Heads, o: Options) -> CouplingCost:
    d, hidden = h.head_dim, o["hidden"]
    # a step: the kick, q + dt * k (multiply-add, k broadcast), k + kick
    vector = _grouped(h, hidden) + 2 * h.q_heads * d + h.kv_heads * d
    return CouplingCost(o["steps"] * _kick_flops(h, hidden), o["steps"] * vector)


def _euler_memory(h: Heads, o: Options) -> CouplingMemory:
    d, steps = h.head_dim, o["steps"]
    elements = h.q_heads * d + steps * _kick_memory(h, o["hidden"]) + (steps - 1) * _step_output(h)
    # dt * k keeps the pre-RoPE k, a view of the QKV output, where no GQA copy intervenes
    return CouplingMemory(elements, keeps_qkv_view=h.q_heads == h.kv_heads)


def _leapfrog_cost(h: Heads, o: Options) -> CouplingCost:
    d, hidden, steps = h.head_dim, o["hidden"], o["steps"]
    # n + 1 kicks (shared between steps); a step adds two half-kicks to k and drifts q
    vector = (steps + 1) * _grouped(h, hidden) + steps * (2 * h.kv_heads * d + 2 * h.q_heads * d)
    return CouplingCost((steps + 1) * _kick_flops(h, hidden), vector)


def _leapfrog_memory(h: Heads, o: Options) -> CouplingMemory:
    d, steps = h.head_dim, o["steps"]
    kicks = (steps + 1) * _kick_memory(h, o["hidden"])
    return CouplingMemory(h.q_heads * d + kicks + steps * _step_output(h))


def _mlp_only_widths(hidden: int) -> tuple[int, int]:
    return hidden // 2, hidden - hidden // 2  # f_q's and f_k's halves, as plain_math.py splits


def _mlp_only_cost(h: Heads, o: Options) -> CouplingCost:
    d, (h_q, h_k) = h.head_dim, _mlp_only_widths(o["hidden"])
    matmul = _mlp_flops(h.q_heads, d, h_q, d) + _mlp_flops(h.kv_heads, d, h_k, d)
    return CouplingCost(o["steps"] * matmul, o["steps"] * (h.q_heads + h.kv_heads) * d)


def _mlp_only_memory(h: Heads, o: Options) -> CouplingMemory:
    d, (h_q, h_k) = h.head_dim, _mlp_only_widths(o["hidden"])

    def mlp(rows: int, width: int) -> float:  # input, fc1 output (SiLU's input), SiLU output
        return rows * (d + 2 * width)

    per_step = mlp(h.q_heads, h_q) + mlp(h.kv_heads, h_k)  # dt folded into fc2 as well
    return CouplingMemory(o["steps"] * per_step, keeps_qkv_view=True)  # f_k's input: k


def _mlp_only_checks(config: Any) -> Iterable[str]:
    hidden = config.attention.coupling_hidden
    hidden = config.model.head_dim if hidden is None else hidden
    if 0 < hidden < 2:  # below 1, validate() refuses it for every coupling
        yield (
            f"attention.coupling_hidden={hidden} is too small (mlp_only splits it between f_q "
            "and f_k: at least 2)"
        )


# --- invertible -------------------------------------------------------------------------------


def _invertible_cost(h: Heads, o: Options) -> CouplingCost:
    d, hidden, hq, hkv = h.head_dim, o["hidden"], h.q_heads, h.kv_heads
    # a layer: the q-net on the key heads (d -> hidden -> 2d), the k-net's first layer and
    # its scale half on the query heads, its shift half on the group-meaned hidden
    per_layer = _mlp_flops(hkv, d, hidden, 2 * d) + 2.0 * hidden * d * (2 * hq + hkv)
    # bounded scale (3 ops) and exp of s1 on the key heads, q's multiply-add; s2's bound on
    # the query heads, its and the hidden's group means, its exp, k's multiply-add
    vector = 4 * hkv * d + 2 * hq * d + 3 * hq * d + _grouped(h, d) + _grouped(h, hidden)
    vector += hkv * d + 2 * hkv * d
    return CouplingCost(o["layers"] * per_layer, o["layers"] * vector)


def _invertible_memory(h: Heads, o: Options) -> CouplingMemory:
    d, hidden, hq, hkv, layers = h.head_dim, o["hidden"], h.q_heads, h.kv_heads, o["layers"]
    # per layer: the q-net on the key heads (fc1 output, SiLU output), its bounded scale and
    # exp on the key heads; q' (the k-net's input); the k-net's fc1 and SiLU outputs on the
    # query heads, the group-meaned SiLU output (t2's input, the same tensor without GQA);
    # the bounded s2 on the query heads and exp(mean s2)
    meaned = hkv * hidden if hq != hkv else 0
    per_layer = 2 * hkv * hidden + 2 * hkv * d + hq * d + 2 * hq * hidden + meaned
    per_layer += hq * d + hkv * d
    elements = hq * d + layers * per_layer + (layers - 1) * hkv * d
    return CouplingMemory(elements, keeps_qkv_view=True)  # the first k update keeps k


# --- scorings -------------------------------------------------------------------------------


def _no_terms(h: Heads) -> dict[str, ActivationTerm]:
    return {}


def _standard_calls(h: Heads) -> AttentionCalls:
    return AttentionCalls(1, h.q_heads, h.kv_heads, h.head_dim)


def _differential_calls(h: Heads) -> AttentionCalls:
    # two maps per differential head (H/2 of them), each applied to a value 2 d wide
    return AttentionCalls(2, h.q_heads // 2, h.kv_heads // 2, 2 * h.head_dim)


def _differential_memory(h: Heads) -> dict[str, ActivationTerm]:
    d, hq = h.head_dim, h.q_heads
    return {
        # the value pairs (a copy), kept by a selective recompute's checkpoint as its input
        "value_pairs": ActivationTerm(h.kv_heads * d, group="core_attention"),
        # RMSNorm over 2d of (A1 - lambda A2) v: the fp32 input, 1/rms, normalised output
        "differential_norm": ActivationTerm(hq * d, dtype="fp32", group="core_attention"),
        "differential_norm_out": ActivationTerm(hq * d, group="core_attention"),
        "differential_norm_stats": ActivationTerm(hq // 2, dtype="fp32", group="core_attention"),
    }


def _differential_checks(config: Any) -> Iterable[str]:
    norm = config.attention.differential_norm
    if norm not in DIFFERENTIAL_NORMS:
        yield (
            f"attention.differential_norm={norm!r} is unknown; choose one of "
            f"{list(DIFFERENTIAL_NORMS)}"
        )
    lambda_init = config.attention.differential_lambda_init
    if lambda_init is not None and not 0 <= lambda_init < 1:
        yield (
            f"attention.differential_lambda_init={lambda_init!r} must lie in [0, 1) (the "
            "paper's norm scales by 1 - lambda_init); null keeps the paper's depth schedule"
        )
    m, tp = config.model, config.parallel.tensor_parallel
    heads, kv_heads = m.num_attention_heads, m.kv_heads
    if heads % tp or kv_heads % tp:
        return  # validate() reports the uneven split itself
    if (heads // tp) % 2:
        yield (
            f"attention.scoring=differential pairs heads, but each tensor-parallel rank holds "
            f"{heads // tp} query heads (model.num_attention_heads={heads} / "
            f"parallel.tensor_parallel={tp}), an odd number; use an even count per rank"
        )
    if (kv_heads // tp) % 2:
        yield (
            f"attention.scoring=differential pairs key/value heads, but each tensor-parallel "
            f"rank holds {kv_heads // tp} (model.num_query_groups={kv_heads} / "
            f"parallel.tensor_parallel={tp}), an odd number; use an even count per rank"
        )


# --- registration ----------------------------------------------------------------------------

for _variant in (
    CouplingVariant("none", None, flops=_no_cost, memory=_nothing_kept),
    CouplingVariant(
        "euler",
        (MATH, "EulerCoupling"),
        INTEGRATOR_OPTIONS,
        fused=(FAST, "euler_form"),
        flops=_euler_cost,
        memory=_euler_memory,
    ),
    CouplingVariant(
        "hamiltonian",
        (MATH, "HamiltonianCoupling"),
        INTEGRATOR_OPTIONS,
        fused=(FAST, "leapfrog_form"),
        flops=_leapfrog_cost,
        memory=_leapfrog_memory,
    ),
    CouplingVariant(
        "mlp_only",
        (MATH, "MLPOnlyCoupling"),
        INTEGRATOR_OPTIONS,
        fused=(FAST, "mlp_only_form"),
        checks=_mlp_only_checks,
        flops=_mlp_only_cost,
        memory=_mlp_only_memory,
    ),
    CouplingVariant(
        "invertible",
        (MATH, "InvertibleCoupling"),
        {
            "hidden": "coupling_hidden",
            "layers": "invertible_layers",
            "scale_bound": "invertible_scale_bound",
        },
        fused=(FAST, "invertible_form"),
        flops=_invertible_cost,
        memory=_invertible_memory,
    ),
):
    register_coupling(_variant)

register_scoring(
    ScoringVariant(
        "standard",
        ("cqk_megatron.model.attention.sdpa", "SDPACoreAttention"),
        calls=_standard_calls,
        memory=_no_terms,
    )
)
register_scoring(
    ScoringVariant(
        "differential",
        ("cqk_megatron.model.attention.differential", "DifferentialCoreAttention"),
        math=(MATH, "DifferentialScoring"),
        math_attribute="differential",
        # each map once, two SDPA calls with values 2 head_dim wide (any kernel serves it)
        export_options={"kernel": "paired"},
        options={"norm": "differential_norm", "lambda_init": "differential_lambda_init"},
        checks=_differential_checks,
        calls=_differential_calls,
        memory=_differential_memory,
        keeps_value_view=False,  # the value pairs are a copy
    )
)

# name, coupling, scoring, aliases (the papers' integrator names, spellings people type)
for _name, _coupling, _scoring, _aliases in (
    ("standard", "none", "standard", ("baseline",)),
    ("coupled", "hamiltonian", "standard", ("hamiltonian", "leapfrog", "coupled_hamiltonian")),
    ("coupled_euler", "euler", "standard", ("euler",)),
    ("mlp_only", "mlp_only", "standard", ()),
    ("invertible", "invertible", "standard", ()),
    ("differential", "none", "differential", ("diff", "diffattn")),
    ("coupled_differential", "hamiltonian", "differential", ()),
    ("invertible_differential", "invertible", "differential", ()),
):
    register_variant(_name, _coupling, _scoring, _aliases)
