"""The math of every attention variant, in plain PyTorch.

This file imports nothing from this package or from Megatron: the Megatron layers in
``cqk_megatron.model.attention`` and the exported Hugging Face modeling code both use it (the
exporter copies it verbatim beside ``modeling_cqk.py``), so the two match by construction.

Shapes follow Megatron: ``q`` is ``[..., q_heads, head_dim]`` and ``k`` is
``[..., kv_heads, head_dim]`` with ``q_heads % kv_heads == 0`` (grouped-query attention);
the leading dimensions (``[seq, batch]`` in Megatron, ``[batch, seq]`` in Hugging Face)
are only carried along, because every coupling acts per token and per head.

Couplings (applied to ``(q, k)`` before scoring; the names, options and costs of each
class are registered in ``cqk_megatron/variants``, which this file does not import):

- ``euler``:        q <- q + dt * k ;  k <- k + dt * f(q_old)
- ``hamiltonian``:  leapfrog, q as position and k as momentum:
                    k_half = k + dt/2 f(q) ; q' = q + dt k_half ; k' = k_half + dt/2 f(q')
- ``mlp_only``:     q <- q + dt f_q(q) ; k <- k + dt f_k(k) (uncoupled ablation, same
                    parameter count as the coupled variants)
- ``invertible``:   alternating affine maps, identity at initialisation:
                    q' = q exp(s1(k)) + t1(k) ; k' = k exp(s2(q')) + t2(q')

Grouped-query attention: a query group reads its shared key (``expand_kv``) and a key
receives the mean over its group of whatever the queries send it (``group_mean``).

Scoring: ``DifferentialScoring`` holds the per-layer parameters of Differential Attention
(Ye et al., 2024) and combines two attention maps; the kernels that produce the maps are
the caller's (SDPA in both Megatron and Hugging Face code). It has two forms of the same
function: ``paired`` attends once per map with the differential head's whole value
(``2 head_dim`` wide), ``split`` twice per map, once per value half, for kernels that need
values as wide as queries.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# The integrators' step counts, inclusive. ``config.validate`` reads this literal from this
# file's source (``variants.options``), so the bound lives here once.
INTEGRATOR_STEPS = (1, 7)


def expand_kv(k: torch.Tensor, group_size: int) -> torch.Tensor:
    """Repeat each key head for the ``group_size`` query heads that read it."""
    if group_size == 1:
        return k
    return k.repeat_interleave(group_size, dim=-2)


def group_mean(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Average query-head quantities over each group: ``[..., hq, d] -> [..., hq/g, d]``."""
    if group_size == 1:
        return x
    return x.reshape(*x.shape[:-2], x.shape[-2] // group_size, group_size, x.shape[-1]).mean(-2)


def _group_size(q: torch.Tensor, k: torch.Tensor) -> int:
    q_heads, kv_heads = q.shape[-2], k.shape[-2]
    if q_heads % kv_heads != 0:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of key heads ({kv_heads})")
    return q_heads // kv_heads


class HeadMLP(nn.Module):
    """Two-layer SiLU MLP on the last dimension, shared by all heads of a layer.

    The output layer has no bias in the integrator couplings: that keeps the parameter
    count linear in ``hidden`` (``hidden * (in + out + 1)``), so the MLP-only ablation can
    split one hidden width between ``f_q`` and ``f_k`` and match the coupled count exactly.
    """

    def __init__(
        self,
        in_dim: int,
        hidden: int,
        out_dim: int | None = None,
        output_bias: bool = False,
        zero_init_output: bool = False,
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, out_dim or in_dim, bias=output_bias)
        if zero_init_output:
            nn.init.zeros_(self.fc2.weight)
            if self.fc2.bias is not None:
                nn.init.zeros_(self.fc2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(F.silu(self.fc1(x)))
        return out


class PositiveStep(nn.Module):
    """A learnable step size kept positive by a softplus: ``dt = softplus(raw)``.

    Stored with shape ``[1]``, not as a 0-dim scalar: DeepSpeed views every parameter as
    bytes to broadcast it, which a 0-dim tensor cannot do.
    """

    def __init__(self, init: float) -> None:
        super().__init__()
        if init <= 0:
            raise ValueError(f"dt_init must be positive, got {init}")
        self.raw = nn.Parameter(torch.tensor([math.log(math.expm1(init))]))

    def forward(self) -> torch.Tensor:
        return F.softplus(self.raw)


class QKCoupling(nn.Module):
    """Base class: maps ``(q, k)`` to coupled ``(q', k')`` of the same shapes."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class _IntegratorCoupling(QKCoupling):
    """Shared state of the ODE couplings: ``f``, ``dt`` and the number of steps."""

    def __init__(self, head_dim: int, hidden: int, steps: int = 1, dt_init: float = 0.1) -> None:
        super().__init__()
        low, high = INTEGRATOR_STEPS
        if not low <= steps <= high:
            raise ValueError(f"steps must be in {low}..{high}, got {steps}")
        self.steps = steps
        self.f = HeadMLP(head_dim, hidden)
        self.dt = PositiveStep(dt_init)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, dt: torch.Tensor | float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Integrate ``steps`` steps; ``dt`` overrides the learned step (e.g. ``-dt``)."""
        step = self.dt() if dt is None else dt
        group = _group_size(q, k)
        for _ in range(self.steps):
            q, k = self.step(q, k, step, group)
        return q, k

    def step(
        self, q: torch.Tensor, k: torch.Tensor, dt: torch.Tensor | float, group: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class EulerCoupling(_IntegratorCoupling):
    """Explicit Euler: ``q <- q + dt k ; k <- k + dt f(q_old)``."""

    def step(
        self, q: torch.Tensor, k: torch.Tensor, dt: torch.Tensor | float, group: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q + dt * expand_kv(k, group), k + dt * group_mean(self.f(q), group)


class HamiltonianCoupling(_IntegratorCoupling):
    """Leapfrog (Stormer-Verlet): time-reversible and volume-preserving for any ``f``."""

    def step(
        self, q: torch.Tensor, k: torch.Tensor, dt: torch.Tensor | float, group: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = k + (dt / 2) * group_mean(self.f(q), group)
        q = q + dt * expand_kv(k, group)
        k = k + (dt / 2) * group_mean(self.f(q), group)
        return q, k


class MLPOnlyCoupling(_IntegratorCoupling):
    """Uncoupled ablation: ``q <- q + dt f_q(q) ; k <- k + dt f_k(k)``.

    ``f_q`` and ``f_k`` split the coupled variant's hidden width, so the ablation has
    exactly the same number of parameters as ``euler``/``hamiltonian``.
    """

    def __init__(self, head_dim: int, hidden: int, steps: int = 1, dt_init: float = 0.1) -> None:
        if hidden < 2:
            raise ValueError(f"mlp_only needs hidden >= 2 to split it, got {hidden}")
        super().__init__(head_dim, hidden, steps, dt_init)
        del self.f
        self.f_q = HeadMLP(head_dim, hidden // 2)
        self.f_k = HeadMLP(head_dim, hidden - hidden // 2)

    def step(
        self, q: torch.Tensor, k: torch.Tensor, dt: torch.Tensor | float, group: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q + dt * self.f_q(q), k + dt * self.f_k(k)


class InvertibleCoupling(QKCoupling):
    """RealNVP-style alternating affine coupling, identity at initialisation.

    Each of ``layers`` layers does ``q' = q exp(s1(k)) + t1(k)`` then
    ``k' = k exp(s2(q')) + t2(q')``. ``s`` and ``t`` come from one SiLU MLP per half
    whose output layer starts at zero; log-scales are bounded by
    ``scale_bound * tanh(s / scale_bound)`` for stability.
    """

    def __init__(
        self, head_dim: int, hidden: int, layers: int = 2, scale_bound: float = 2.0
    ) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"invertible coupling needs layers >= 1, got {layers}")
        if scale_bound <= 0:
            raise ValueError(f"scale_bound must be positive, got {scale_bound}")
        self.scale_bound = scale_bound
        self.q_nets = nn.ModuleList(
            HeadMLP(head_dim, hidden, 2 * head_dim, output_bias=True, zero_init_output=True)
            for _ in range(layers)
        )
        self.k_nets = nn.ModuleList(
            HeadMLP(head_dim, hidden, 2 * head_dim, output_bias=True, zero_init_output=True)
            for _ in range(layers)
        )

    def _scale_shift(self, net: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, t = net(x).chunk(2, dim=-1)
        return self.scale_bound * torch.tanh(s / self.scale_bound), t

    def forward_with_logdet(
        self, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Coupled ``(q', k')`` and ``log|det J|`` per token (summed over heads and dims)."""
        group = _group_size(q, k)
        logdet = q.new_zeros(q.shape[:-2])
        for q_net, k_net in zip(self.q_nets, self.k_nets, strict=True):
            s1, t1 = self._scale_shift(q_net, expand_kv(k, group))
            q = q * torch.exp(s1) + t1
            s2, t2 = self._scale_shift(k_net, q)
            s2, t2 = group_mean(s2, group), group_mean(t2, group)
            k = k * torch.exp(s2) + t2
            logdet = logdet + s1.sum(dim=(-2, -1)) + s2.sum(dim=(-2, -1))
        return q, k, logdet

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = self.forward_with_logdet(q, k)
        return q, k

    def inverse(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact inverse of ``forward``: undo the layers in reverse order."""
        group = _group_size(q, k)
        for q_net, k_net in zip(reversed(self.q_nets), reversed(self.k_nets), strict=True):
            s2, t2 = self._scale_shift(k_net, q)
            s2, t2 = group_mean(s2, group), group_mean(t2, group)
            k = (k - t2) * torch.exp(-s2)
            s1, t1 = self._scale_shift(q_net, expand_kv(k, group))
            q = (q - t1) * torch.exp(-s1)
        return q, k


# ---------------------------------------------------------------------------------------
# Differential Attention (Ye et al., 2024)
# ---------------------------------------------------------------------------------------


def differential_lambda_init(layer_index: int) -> float:
    """``0.8 - 0.6 exp(-0.3 l)`` for the 0-based layer index ``l``."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_index)


class RMSNorm(nn.Module):
    """RMSNorm with a learnable scale over the last dimension (the per-head ``subln``)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_float = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16 -> fp32, fp64 stays
        normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


DIFFERENTIAL_KERNELS = ("paired", "split")
# What follows ``out1 - lambda out2`` in a differential head (attention.differential_norm):
# ``paper``: the learnable RMSNorm over 2 head_dim, times 1 - lambda_init (Ye et al.);
# ``none``: nothing (``out1 - lambda out2`` as it is); ``small_start``: the paper's norm
# with its weight starting at SMALL_START_WEIGHT instead of 1.
DIFFERENTIAL_NORMS = ("paper", "none", "small_start")
# The paper's norm writes about 12x (layer 1) to 5x (layer 4) standard attention's output
# scale into the residual stream at initialisation (N(0, 0.02), width 128: 0.065..0.037
# against 0.0037..0.0075, docs/results.md); 0.1 is about the geometric mean of the four
# ratios (0.11), so the sub-layer starts near standard attention's scale.
SMALL_START_WEIGHT = 0.1


def pair_values(v: torch.Tensor) -> torch.Tensor:
    """``[b, Hk, s, d] -> [b, Hk/2, s, 2d]``: value heads ``2j`` and ``2j+1`` side by side."""
    pairs = v.reshape(v.shape[0], v.shape[1] // 2, 2, *v.shape[2:])
    return pairs.transpose(2, 3).flatten(-2)


class DifferentialScoring(nn.Module):
    """Per-layer parameters and combination rule of Differential Attention.

    The layer's ``H`` heads pair up into ``H/2`` differential heads: heads ``2i`` and
    ``2i+1`` give ``(q1, k1)`` and ``(q2, k2)``, value heads ``2j`` and ``2j+1`` form one
    value of width ``2 head_dim``. The output of a differential head is
    ``(1 - lambda_init) * RMSNorm((A1 - lambda A2) v)`` with
    ``lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init``.

    ``norm`` (one of ``DIFFERENTIAL_NORMS``) says what follows ``(A1 - lambda A2) v``: the
    paper's ``(1 - lambda_init) RMSNorm``, nothing (``none``: no ``subln`` either), or the
    paper's norm with its weight starting at ``SMALL_START_WEIGHT`` (``small_start``).
    ``lambda_init``: the same constant in every layer instead of the paper's depth schedule
    (``differential_lambda_init``; None keeps it).

    ``kernel`` says how the two maps meet the value (same function either way):
    ``paired`` (two attention calls, each with the ``2 head_dim`` value) or ``split``
    (four calls, each map once per ``head_dim`` half of the value: a kernel that needs
    values as wide as queries, e.g. flash attention, takes these).
    """

    def __init__(
        self,
        head_dim: int,
        layer_index: int,
        eps: float = 1e-5,
        kernel: str = "paired",
        norm: str = "paper",
        lambda_init: float | None = None,
    ) -> None:
        super().__init__()
        if kernel not in DIFFERENTIAL_KERNELS:
            raise ValueError(f"kernel must be one of {DIFFERENTIAL_KERNELS}, got {kernel!r}")
        if norm not in DIFFERENTIAL_NORMS:
            raise ValueError(f"norm must be one of {DIFFERENTIAL_NORMS}, got {norm!r}")
        self.kernel = kernel
        self.norm = norm
        self.head_dim = head_dim
        if lambda_init is None:
            lambda_init = differential_lambda_init(layer_index)
        elif not 0 <= lambda_init < 1:
            raise ValueError(f"lambda_init must lie in [0, 1), got {lambda_init!r}")
        self.lambda_init = lambda_init
        self.lambda_q1 = nn.Parameter(torch.zeros(head_dim).normal_(0, 0.1))
        self.lambda_k1 = nn.Parameter(torch.zeros(head_dim).normal_(0, 0.1))
        self.lambda_q2 = nn.Parameter(torch.zeros(head_dim).normal_(0, 0.1))
        self.lambda_k2 = nn.Parameter(torch.zeros(head_dim).normal_(0, 0.1))
        self.subln: RMSNorm | None = None
        if norm != "none":
            self.subln = RMSNorm(2 * head_dim, eps=eps)
            if norm == "small_start":
                nn.init.constant_(self.subln.weight, SMALL_START_WEIGHT)

    def lambda_full(self) -> torch.Tensor:
        dtype = torch.promote_types(self.lambda_q1.dtype, torch.float32)
        lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1).to(dtype))
        lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2).to(dtype))
        return lambda_1 - lambda_2 + self.lambda_init

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Differential attention in SDPA layout.

        ``q``: ``[b, H, s, d]``; ``k``, ``v``: ``[b, Hk, s, d]``; ``attend(q, k, v)`` is the
        caller's softmax attention (causal, grouped-query aware, values of any width).
        Returns ``[b, H/2, s, 2d]``: differential head ``i`` in the place of heads
        ``2i, 2i+1``. Under GQA, differential query head ``i`` reads key/value pair
        ``i // (H / Hk)``, as ``attend`` does for its heads.
        """
        return self.combine(*self.attend_maps(q, k, v, attend))

    def attend_maps(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A1 v, A2 v)``, each ``[b, H/2, s, 2d]``, in the form ``self.kernel`` names."""
        q1, q2 = q[:, 0::2], q[:, 1::2]
        k1, k2 = k[:, 0::2], k[:, 1::2]
        if self.kernel == "paired":
            value = pair_values(v)
            return attend(q1, k1, value), attend(q2, k2, value)
        v_even, v_odd = v[:, 0::2], v[:, 1::2]
        out1 = torch.cat((attend(q1, k1, v_even), attend(q1, k1, v_odd)), dim=-1)
        out2 = torch.cat((attend(q2, k2, v_even), attend(q2, k2, v_odd)), dim=-1)
        return out1, out2

    def combine(self, out1: torch.Tensor, out2: torch.Tensor) -> torch.Tensor:
        """``(1 - lambda_init) RMSNorm(out1 - lambda out2)``; inputs ``[..., 2 head_dim]``."""
        return self.normalize(out1 - self.lambda_full().type_as(out1) * out2)

    def normalize(self, diff: torch.Tensor) -> torch.Tensor:
        """``(1 - lambda_init) RMSNorm(diff)`` over the ``2 head_dim`` of a differential head
        (``diff`` itself with ``norm="none"``)."""
        if self.subln is None:
            return diff
        normed: torch.Tensor = self.subln(diff)
        return normed * (1 - self.lambda_init)
