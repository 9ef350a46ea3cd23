"""The couplings of ``cqk_megatron.variants.plain_math`` in a form with fewer kernels and copies.

``plain_math.py`` stays the readable reference (and is what Hugging Face exports run);
this module computes the same functions from the same parameters, rearranged so that
less is computed and an elementwise chain can fuse:

- Grouped-query attention without copies: ``q + dt * expand_kv(k)`` is a broadcast of
  ``k`` over each query group (``addcmul`` on an ``[..., kv, group, d]`` view), never a
  ``repeat_interleave``.
- ``group_mean(f(q)) = fc2(group_mean(silu(fc1(q))))``: ``fc2`` is linear without bias in
  the integrators, so the mean over a query group is taken before it and ``fc2`` runs on
  the key heads only (``group`` times fewer rows).
- Leapfrog steps share their kick: the second half-kick of a step and the first of the
  next evaluate ``f`` at the same ``q``, so ``n`` steps evaluate ``f`` ``n + 1`` times,
  not ``2n`` (the Euler step already evaluates it once per step, on ``q`` only: there is
  no ``f(k)`` to batch with ``f(q)`` in either integrator).
- ``k + dt * f(q)``: ``fc2`` has no bias, so ``dt`` is folded into its ``d x hidden``
  weight; the product with ``dt`` and ``dt``'s gradient then cost an op on that weight
  instead of two passes over every token's ``k``-sized kick in the backward.
- ``q + dt * k`` is one ``addcmul`` (the step size is a tensor, so ``add(alpha=)`` can't).
- The invertible coupling's ``s1, t1`` come from the key heads and are broadcast over the
  group (the reference evaluates the net on the expanded keys); the shift ``t2`` is
  linear in the hidden activation, so its group mean is also taken before its matmul.

Each registered coupling names its fused form (``CouplingVariant.fused``, one of the
``*_form`` functions below for those that ship): ``(module, q, k) -> (function, parameter
tensors, options)``. ``run_coupling`` applies one of these to ``(q, k)``: eagerly,
through ``torch.compile`` (``attention.coupling_impl=compiled``; inductor then fuses the
elementwise work into the matmuls' neighbours), and optionally under
``torch.utils.checkpoint`` so the backward recomputes the coupling instead of storing its
intermediates (``attention.recompute_coupling``). Every function takes the parameters as tensors, so
one compiled graph serves every layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._dynamo.exc import TorchDynamoException
from torch.utils.checkpoint import checkpoint

from cqk_megatron.variants import COUPLING_IMPLS, coupling_for_class
from cqk_megatron.variants.plain_math import (
    HeadMLP,
    InvertibleCoupling,
    MLPOnlyCoupling,
    QKCoupling,
    _group_size,
)

# How a layer runs its coupling: attention.coupling_impl's choices once ``auto`` is
# resolved (``resolve_impl``), and the module itself (``reference``: benchmarks and tests).
RUN_IMPLS = (*(impl for impl in COUPLING_IMPLS if impl != "auto"), "reference")


# --- building blocks (shapes ``[..., heads, d]``) ------------------------------------------


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[..., hq, d] -> [..., hq / group, group, d]`` (a view)."""
    return x.unflatten(-2, (x.shape[-2] // group, group))


def _add_expanded_kv(
    q: torch.Tensor, scale: torch.Tensor, k: torch.Tensor, group: int
) -> torch.Tensor:
    """``q + scale * expand_kv(k)`` by broadcasting ``k`` over each query group."""
    if group == 1:
        return torch.addcmul(q, scale, k)
    return torch.addcmul(_grouped(q, group), scale, k.unsqueeze(-2)).flatten(-3, -2)


def _hidden(x: torch.Tensor, fc1_weight, fc1_bias) -> torch.Tensor:
    return F.silu(F.linear(x, fc1_weight, fc1_bias))


def _group_mean(x: torch.Tensor, group: int) -> torch.Tensor:
    return x if group == 1 else _grouped(x, group).mean(dim=-2)


def _kick(q: torch.Tensor, fc1_weight, fc1_bias, fc2_weight, group: int) -> torch.Tensor:
    """``group_mean(f(q))``, with the mean taken before ``f``'s (bias-free) output layer."""
    return F.linear(_group_mean(_hidden(q, fc1_weight, fc1_bias), group), fc2_weight)


# --- the couplings, as functions of tensors ------------------------------------------------


def euler(q, k, fc1_weight, fc1_bias, fc2_weight, dt_raw, *, steps: int, group: int):
    dt = F.softplus(dt_raw)
    dt_fc2 = fc2_weight * dt  # dt f = f with dt folded into its output layer
    for _ in range(steps):
        kick = _kick(q, fc1_weight, fc1_bias, dt_fc2, group)
        q = _add_expanded_kv(q, dt, k, group)
        k = k + kick
    return q, k


def leapfrog(q, k, fc1_weight, fc1_bias, fc2_weight, dt_raw, *, steps: int, group: int):
    dt = F.softplus(dt_raw)
    half_fc2 = fc2_weight * (dt / 2)  # (dt / 2) f = f with dt / 2 folded into fc2
    kick = _kick(q, fc1_weight, fc1_bias, half_fc2, group)
    for _ in range(steps):
        k = k + kick
        q = _add_expanded_kv(q, dt, k, group)
        kick = _kick(q, fc1_weight, fc1_bias, half_fc2, group)  # also the next step's
        k = k + kick
    return q, k


def mlp_only(q, k, q_fc1_w, q_fc1_b, q_fc2_w, k_fc1_w, k_fc1_b, k_fc2_w, dt_raw, *, steps: int):
    dt = F.softplus(dt_raw)
    q_fc2_w, k_fc2_w = q_fc2_w * dt, k_fc2_w * dt  # dt folded into the output layers
    for _ in range(steps):
        q, k = (
            q + F.linear(_hidden(q, q_fc1_w, q_fc1_b), q_fc2_w),
            k + F.linear(_hidden(k, k_fc1_w, k_fc1_b), k_fc2_w),
        )
    return q, k


def _bounded(s: torch.Tensor, bound: float) -> torch.Tensor:
    return bound * torch.tanh(s / bound)


def invertible(q, k, *nets: torch.Tensor, layers: int, bound: float, group: int):
    """``nets``: per layer, ``q_net`` then ``k_net`` as (fc1 w, fc1 b, fc2 w, fc2 b)."""
    d = q.shape[-1]
    for layer in range(layers):
        qw1, qb1, qw2, qb2, kw1, kb1, kw2, kb2 = nets[8 * layer : 8 * layer + 8]
        # q' = q exp(s1(k)) + t1(k): the net sees each key head once, then broadcasts
        s1, t1 = F.linear(_hidden(k, qw1, qb1), qw2, qb2).chunk(2, dim=-1)
        scale = torch.exp(_bounded(s1, bound))
        if group == 1:
            q = torch.addcmul(t1, q, scale)
        else:
            q = torch.addcmul(t1.unsqueeze(-2), _grouped(q, group), scale.unsqueeze(-2))
            q = q.flatten(-3, -2)
        # k' = k exp(group_mean(s2(q'))) + group_mean(t2(q')); t2 is linear in the hidden
        hidden = _hidden(q, kw1, kb1)
        s2 = _group_mean(_bounded(F.linear(hidden, kw2[:d], kb2[:d]), bound), group)
        t2 = F.linear(_group_mean(hidden, group), kw2[d:], kb2[d:])
        k = torch.addcmul(t2, k, torch.exp(s2))
    return q, k


# --- from a reference module to (function, parameter tensors) ------------------------------


def _mlp_tensors(net: HeadMLP) -> list[torch.Tensor]:
    tensors = [net.fc1.weight, net.fc1.bias, net.fc2.weight]
    return tensors + ([net.fc2.bias] if net.fc2.bias is not None else [])


def _integrator_form(function: Callable) -> Callable:
    def form(coupling, q, k):
        group = _group_size(q, k)
        tensors = [*_mlp_tensors(coupling.f), coupling.dt.raw]
        return function, tensors, {"steps": coupling.steps, "group": group}

    return form


def mlp_only_form(coupling: MLPOnlyCoupling, q, k):
    _group_size(q, k)  # same check as the reference
    tensors = [*_mlp_tensors(coupling.f_q), *_mlp_tensors(coupling.f_k), coupling.dt.raw]
    return mlp_only, tensors, {"steps": coupling.steps}


def invertible_form(coupling: InvertibleCoupling, q, k):
    tensors = [
        t
        for q_net, k_net in zip(coupling.q_nets, coupling.k_nets, strict=True)
        for t in (*_mlp_tensors(q_net), *_mlp_tensors(k_net))
    ]
    options = {
        "layers": len(coupling.q_nets),
        "bound": coupling.scale_bound,
        "group": _group_size(q, k),
    }
    return invertible, tensors, options


euler_form = _integrator_form(euler)
leapfrog_form = _integrator_form(leapfrog)


def fused_form(coupling: QKCoupling) -> Callable | None:
    """The fused form registered with exactly this module's class (a subclass may change
    the math, so it is not given its parent's), or None."""
    variant = coupling_for_class(type(coupling))
    return None if variant is None else variant.fused_form()


def has_fused_form(coupling: QKCoupling) -> bool:
    return fused_form(coupling) is not None


def resolve_impl(impl: str, coupling: QKCoupling | None, device_type: str) -> str:
    """``attention.coupling_impl=auto`` on ``device_type``: compiled on GPU, where inductor
    fuses the coupling's elementwise chain into a few kernels (the counts are in
    docs/performance.md), for a coupling with a fused form; eager elsewhere (on CPU
    compiling costs seconds a shape and saves nothing measurable). Other choices as they
    are."""
    if impl != "auto":
        return impl
    compilable = coupling is not None and has_fused_form(coupling)
    return "compiled" if device_type == "cuda" and compilable else "eager"


# --- running a coupling ---------------------------------------------------------------------

_COMPILED: dict[Callable, Callable] = {}


def _compiled(function: Callable) -> Callable:
    """One ``torch.compile`` of each function, shared by every layer (tensors are inputs).

    Static shapes: a training run has one shape; a new one (evaluation at another batch
    size) compiles again, and past dynamo's recompile limit runs eagerly with a warning.
    """
    if function not in _COMPILED:
        _COMPILED[function] = torch.compile(function, fullgraph=True, dynamic=False)
    return _COMPILED[function]


def _call_compiled(function: Callable, q, k, tensors, options):
    try:
        return _compiled(function)(q, k, *tensors, **options)
    # Only compiler errors: other exceptions (checkpoint's early stop of a recompute
    # among them) pass through untouched.
    except TorchDynamoException as error:  # dynamo, inductor, a missing C++ compiler ...
        raise RuntimeError(
            f"attention.coupling_impl=compiled: torch.compile of the coupling failed "
            f"({type(error).__name__}: {error}); set attention.coupling_impl=eager to run "
            "the same coupling without compiling it"
        ) from error


def fused_coupling(coupling: QKCoupling, q, k, compiled: bool = False):
    """The fused form of ``coupling`` applied to ``(q, k)``, compiled or not."""
    form = fused_form(coupling)
    if form is None:
        raise NotImplementedError(
            f"{type(coupling).__name__} has no fused form; give its registration one "
            "(CouplingVariant.fused, docs/variants.md: Adding a variant) or set "
            "attention.coupling_impl=eager"
        )
    function, tensors, options = form(coupling, q, k)
    if compiled:
        return _call_compiled(function, q, k, tensors, options)
    return function(q, k, *tensors, **options)


def apply_coupling(coupling: QKCoupling, q, k, impl: str = "eager"):
    """``eager``: the fused form (the reference module for a class without one);
    ``compiled``: the fused form under ``torch.compile``; ``reference``: the module of
    ``plain_math.py`` itself (for benchmarks and tests, not a config choice)."""
    if impl == "compiled" or (impl == "eager" and has_fused_form(coupling)):
        return fused_coupling(coupling, q, k, compiled=impl == "compiled")
    if impl in ("eager", "reference"):
        return coupling(q, k)
    raise ValueError(f"attention.coupling_impl={impl!r} is unknown; choose one of {RUN_IMPLS}")


def run_coupling(
    coupling: QKCoupling, q, k, impl: str = "eager", recompute: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Couple ``(q, k)``; with ``recompute`` the backward recomputes the coupling from
    ``q, k`` instead of storing its intermediates. Only the inputs are then kept: in
    Megatron ``k`` (and ``q`` without GQA) is a view of the QKV projection's output,
    kept anyway; with GQA ``q`` is a reshaped copy, one q-sized tensor per layer."""
    if not recompute or not torch.is_grad_enabled():
        return apply_coupling(coupling, q, k, impl)
    # No randomness inside a coupling: skip saving and restoring the RNG states.
    return checkpoint(
        apply_coupling, coupling, q, k, impl, use_reentrant=False, preserve_rng_state=False
    )
