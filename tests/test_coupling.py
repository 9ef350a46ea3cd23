"""Independent tests of ``cqk_megatron.variants.plain_math`` against the design-doc specification.

Every reference in this file is written from the specification, not from the module:
grouped-query bookkeeping is done with explicit per-head loops (query head ``h`` reads key
head ``h // group``; key head ``j`` receives the mean over query heads
``j*group .. (j+1)*group - 1``), and Differential Attention is computed with explicit
causal softmax matrices.  The module only lends its learned ``f`` and ``dt``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cqk_megatron import variants as V
from cqk_megatron.variants import plain_math as C

# ---------------------------------------------------------------------------------------
# helpers (independent of the module under test)
# ---------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, dtype=torch.float64, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=dtype) * scale


def ref_expand(k: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Query head ``h`` reads key head ``h // group`` (explicit loop)."""
    group = q_heads // k.shape[-2]
    return torch.stack([k[..., h // group, :] for h in range(q_heads)], dim=-2)


def ref_group_mean(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Key head ``j`` receives the mean over its group of query heads (explicit loop)."""
    group = x.shape[-2] // kv_heads
    return torch.stack(
        [x[..., j * group : (j + 1) * group, :].mean(dim=-2) for j in range(kv_heads)], dim=-2
    )


def ref_euler(f, dt, q, k, steps):
    hq, hk = q.shape[-2], k.shape[-2]
    for _ in range(steps):
        q, k = q + dt * ref_expand(k, hq), k + dt * ref_group_mean(f(q), hk)
    return q, k


def ref_leapfrog(f, dt, q, k, steps):
    hq, hk = q.shape[-2], k.shape[-2]
    for _ in range(steps):
        k_half = k + (dt / 2) * ref_group_mean(f(q), hk)
        q = q + dt * ref_expand(k_half, hq)
        k = k_half + (dt / 2) * ref_group_mean(f(q), hk)
    return q, k


def ref_mlp_only(f_q, f_k, dt, q, k, steps):
    for _ in range(steps):
        q, k = q + dt * f_q(q), k + dt * f_k(k)
    return q, k


def token_jacobian(fn, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Jacobian of the flattened map ``(q, k) -> fn(q, k)`` for one token."""
    nq = q.numel()

    def flat(x: torch.Tensor) -> torch.Tensor:
        q2, k2 = fn(x[:nq].reshape(q.shape), x[nq:].reshape(k.shape))
        return torch.cat([q2.reshape(-1), k2.reshape(-1)])

    return torch.autograd.functional.jacobian(flat, torch.cat([q.reshape(-1), k.reshape(-1)]))


def perturb_(module: nn.Module, std: float, seed: int) -> None:
    g = _gen(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)


def make_integrator(cls, head_dim=6, hidden=10, steps=1, dt_init=0.3, seed=0):
    torch.manual_seed(seed)
    return cls(head_dim=head_dim, hidden=hidden, steps=steps, dt_init=dt_init).double()


INTEGRATORS = [C.EulerCoupling, C.HamiltonianCoupling, C.MLPOnlyCoupling]
REFS = {C.EulerCoupling: ref_euler, C.HamiltonianCoupling: ref_leapfrog}
# (q heads, kv heads): MHA and GQA
HEADS = [pytest.param(4, 4, id="mha"), pytest.param(4, 2, id="gqa2"), pytest.param(6, 2, id="gqa3")]


# ---------------------------------------------------------------------------------------
# sanity of the helpers themselves (so a wrong reference cannot silently agree)
# ---------------------------------------------------------------------------------------


def test_reference_helpers_are_interleaved_groups():
    k = torch.arange(2.0).view(2, 1)  # key heads 0, 1
    assert ref_expand(k, 4).view(-1).tolist() == [0.0, 0.0, 1.0, 1.0]
    x = torch.tensor([[1.0], [3.0], [10.0], [20.0]])
    assert ref_group_mean(x, 2).view(-1).tolist() == [2.0, 15.0]


def test_module_gqa_helpers_match_spec():
    k = _randn(3, 2, 2, 5, seed=1)
    assert torch.equal(C.expand_kv(k, 3), ref_expand(k, 6))
    x = _randn(3, 2, 6, 5, seed=2)
    torch.testing.assert_close(C.group_mean(x, 3), ref_group_mean(x, 2), rtol=0, atol=1e-15)


# ---------------------------------------------------------------------------------------
# 1. Euler / Hamiltonian / MLP-only against hand-written formulas
# ---------------------------------------------------------------------------------------


def test_head_mlp_is_two_layer_silu():
    torch.manual_seed(0)
    mod = C.EulerCoupling(head_dim=5, hidden=7).double()
    perturb_(mod, 0.3, seed=3)
    x = _randn(3, 2, 4, 5, seed=4)
    w1, b1, w2 = mod.f.fc1.weight, mod.f.fc1.bias, mod.f.fc2.weight
    assert w1.shape == (7, 5) and w2.shape == (5, 7)
    h = x @ w1.T + b1
    expected = (h * torch.sigmoid(h)) @ w2.T
    if mod.f.fc2.bias is not None:
        expected = expected + mod.f.fc2.bias
    torch.testing.assert_close(mod.f(x), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cls", [C.EulerCoupling, C.HamiltonianCoupling])
@pytest.mark.parametrize("hq,hk", HEADS)
@pytest.mark.parametrize("steps", [1, 2, 3, 7])
def test_integrator_matches_handwritten_formula(cls, hq, hk, steps):
    mod = make_integrator(cls, steps=steps, seed=steps)
    perturb_(mod, 0.2, seed=10 + steps)
    q = _randn(5, 2, hq, 6, seed=20)
    k = _randn(5, 2, hk, 6, seed=21)
    q2, k2 = mod(q, k)
    assert q2.shape == q.shape and k2.shape == k.shape
    with torch.no_grad():
        rq, rk = REFS[cls](mod.f, mod.dt(), q, k, steps)
    torch.testing.assert_close(q2, rq, rtol=0, atol=1e-12)
    torch.testing.assert_close(k2, rk, rtol=0, atol=1e-12)
    # the coupling actually changed something
    assert (q2 - q).abs().max() > 1e-2 and (k2 - k).abs().max() > 1e-2


@pytest.mark.parametrize("cls", [C.EulerCoupling, C.HamiltonianCoupling])
def test_euler_and_leapfrog_differ(cls):
    """Guard against the two references (or the two classes) being the same map."""
    mod = make_integrator(cls, steps=2)
    q, k = _randn(3, 4, 6, seed=1), _randn(3, 4, 6, seed=2)
    other = ref_leapfrog if cls is C.EulerCoupling else ref_euler
    with torch.no_grad():
        oq, ok = other(mod.f, mod.dt(), q, k, 2)
        q2, k2 = mod(q, k)
    assert (q2 - oq).abs().max() > 1e-4 or (k2 - ok).abs().max() > 1e-4


@pytest.mark.parametrize("cls", [C.EulerCoupling, C.HamiltonianCoupling])
@pytest.mark.parametrize("dt", [0.05, -0.7])
def test_integrator_dt_override(cls, dt):
    mod = make_integrator(cls, steps=3)
    q, k = _randn(4, 4, 6, seed=5), _randn(4, 2, 6, seed=6)
    with torch.no_grad():
        rq, rk = REFS[cls](mod.f, dt, q, k, 3)
        for override in (dt, torch.tensor(dt, dtype=torch.float64)):
            q2, k2 = mod(q, k, dt=override)
            torch.testing.assert_close(q2, rq, rtol=0, atol=1e-12)
            torch.testing.assert_close(k2, rk, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cls", [C.EulerCoupling, C.HamiltonianCoupling, C.MLPOnlyCoupling])
@pytest.mark.parametrize("lead", [(), (7,), (3, 2), (2, 3, 2)])
def test_any_leading_dims(cls, lead):
    """Couplings act per token: a batch equals the token-by-token application."""
    mod = make_integrator(cls, steps=2)
    q, k = _randn(*lead, 4, 6, seed=7), _randn(*lead, 2, 6, seed=8)
    with torch.no_grad():
        q2, k2 = mod(q, k)
        assert q2.shape == q.shape and k2.shape == k.shape
        fq, fk = q.reshape(-1, 4, 6), k.reshape(-1, 2, 6)
        for i in range(fq.shape[0]):
            tq, tk = mod(fq[i], fk[i])
            torch.testing.assert_close(q2.reshape(-1, 4, 6)[i], tq, rtol=0, atol=1e-12)
            torch.testing.assert_close(k2.reshape(-1, 2, 6)[i], tk, rtol=0, atol=1e-12)


@pytest.mark.parametrize("hq,hk", HEADS)
@pytest.mark.parametrize("steps", [1, 3])
def test_mlp_only_matches_handwritten_formula(hq, hk, steps):
    mod = make_integrator(C.MLPOnlyCoupling, hidden=9, steps=steps)
    perturb_(mod, 0.2, seed=30)
    q, k = _randn(5, 2, hq, 6, seed=31), _randn(5, 2, hk, 6, seed=32)
    q2, k2 = mod(q, k)
    with torch.no_grad():
        rq, rk = ref_mlp_only(mod.f_q, mod.f_k, mod.dt(), q, k, steps)
    torch.testing.assert_close(q2, rq, rtol=0, atol=1e-12)
    torch.testing.assert_close(k2, rk, rtol=0, atol=1e-12)


def test_mlp_only_is_uncoupled():
    """q' must not depend on k and k' must not depend on q."""
    mod = make_integrator(C.MLPOnlyCoupling, steps=3)
    q, k = _randn(4, 6, seed=1), _randn(2, 6, seed=2)
    jac = token_jacobian(mod, q, k)
    nq = q.numel()
    assert jac[:nq, nq:].abs().max() == 0
    assert jac[nq:, :nq].abs().max() == 0
    assert jac[:nq, :nq].abs().max() > 0 and jac[nq:, nq:].abs().max() > 0


def test_indivisible_heads_rejected():
    mod = make_integrator(C.EulerCoupling)
    with pytest.raises(ValueError):
        mod(_randn(3, 6, seed=1), _randn(2, 6, seed=2))
    inv = C.InvertibleCoupling(head_dim=6, hidden=8)
    with pytest.raises(ValueError):
        inv(_randn(3, 6, seed=1, dtype=torch.float32), _randn(2, 6, seed=2, dtype=torch.float32))


# ---------------------------------------------------------------------------------------
# 2. time reversibility
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("hq,hk", HEADS)
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_leapfrog_time_reversible(hq, hk, steps, dtype):
    torch.manual_seed(steps)
    mod = C.HamiltonianCoupling(head_dim=6, hidden=12, steps=steps, dt_init=0.4).to(dtype)
    perturb_(mod, 0.3, seed=40)
    q, k = _randn(5, 2, hq, 6, seed=41, dtype=dtype), _randn(5, 2, hk, 6, seed=42, dtype=dtype)
    with torch.no_grad():
        dt = mod.dt()
        q2, k2 = mod(q, k, dt=dt)
        assert (q2 - q).abs().max() > 1e-2
        qb, kb = mod(q2, k2, dt=-dt)
    torch.testing.assert_close(qb, q, rtol=0, atol=1e-5)
    torch.testing.assert_close(kb, k, rtol=0, atol=1e-5)


@pytest.mark.parametrize("hq,hk", HEADS)
@pytest.mark.parametrize("steps", [1, 3])
def test_euler_not_time_reversible(hq, hk, steps):
    torch.manual_seed(steps)
    mod = C.EulerCoupling(head_dim=6, hidden=12, steps=steps, dt_init=0.4).double()
    perturb_(mod, 0.3, seed=40)
    q, k = _randn(5, 2, hq, 6, seed=41), _randn(5, 2, hk, 6, seed=42)
    with torch.no_grad():
        dt = mod.dt()
        qb, kb = mod(*mod(q, k, dt=dt), dt=-dt)
    err = max((qb - q).abs().max().item(), (kb - k).abs().max().item())
    assert err > 1e-3


# ---------------------------------------------------------------------------------------
# 3. volume preservation
# ---------------------------------------------------------------------------------------


def _with_linear_f(cls, head_dim, steps, seed):
    mod = make_integrator(cls, head_dim=head_dim, hidden=4, steps=steps, dt_init=0.6, seed=seed)
    lin = nn.Linear(head_dim, head_dim).double()
    with torch.no_grad():
        lin.weight.copy_(_randn(head_dim, head_dim, seed=seed + 100))
        lin.bias.copy_(_randn(head_dim, seed=seed + 101))
    mod.f = lin
    return mod


@pytest.mark.parametrize("hq,hk", [(2, 2), (2, 1), (4, 2)])
@pytest.mark.parametrize("steps", [1, 3])
def test_volume_linear_f(hq, hk, steps):
    q, k = _randn(hq, 3, seed=50), _randn(hk, 3, seed=51)
    ham = _with_linear_f(C.HamiltonianCoupling, 3, steps, seed=5)
    det_h = torch.linalg.det(token_jacobian(ham, q, k)).item()
    assert abs(det_h - 1) < 1e-6
    eul = _with_linear_f(C.EulerCoupling, 3, steps, seed=5)
    det_e = torch.linalg.det(token_jacobian(eul, q, k)).item()
    assert abs(det_e - 1) > 1e-2


@pytest.mark.parametrize("hq,hk", [(2, 2), (2, 1), (4, 2)])
@pytest.mark.parametrize("steps", [1, 2, 5])
def test_volume_nonlinear_f_leapfrog(hq, hk, steps):
    ham = make_integrator(C.HamiltonianCoupling, head_dim=3, hidden=8, steps=steps, dt_init=0.8)
    perturb_(ham, 0.8, seed=60)
    q, k = _randn(hq, 3, seed=61), _randn(hk, 3, seed=62)
    jac = token_jacobian(ham, q, k)
    assert (jac - torch.eye(jac.shape[0], dtype=jac.dtype)).abs().max() > 1e-2  # nontrivial
    assert abs(torch.linalg.det(jac).item() - 1) < 1e-6


# ---------------------------------------------------------------------------------------
# 4. steps range
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", INTEGRATORS)
@pytest.mark.parametrize("steps", range(1, 8))
def test_steps_1_to_7_run(cls, steps):
    torch.manual_seed(steps)
    mod = cls(head_dim=8, hidden=6, steps=steps)
    assert mod.steps == steps
    q, k = torch.randn(5, 2, 4, 8), torch.randn(5, 2, 2, 8)
    q2, k2 = mod(q, k)
    assert q2.shape == q.shape and k2.shape == k.shape
    assert q2.dtype == q.dtype and k2.dtype == k.dtype
    assert torch.isfinite(q2).all() and torch.isfinite(k2).all()


@pytest.mark.parametrize("cls", INTEGRATORS)
@pytest.mark.parametrize("steps", [0, 8, -1, 100])
def test_steps_out_of_range_rejected(cls, steps):
    with pytest.raises(ValueError):
        cls(head_dim=8, hidden=6, steps=steps)
    with pytest.raises(ValueError):
        V.build_coupling(cls_kind(cls), 8, hidden=6, steps=steps)


def cls_kind(cls) -> str:
    return V.coupling_for_class(cls).name


# ---------------------------------------------------------------------------------------
# 5. dt positivity and gradients
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", INTEGRATORS)
@pytest.mark.parametrize("dt_init", [0.01, 0.1, 0.5, 2.0])
def test_dt_init_and_softplus(cls, dt_init):
    mod = cls(head_dim=4, hidden=4, dt_init=dt_init)
    assert mod.dt().item() == pytest.approx(dt_init, rel=1e-5)
    assert mod.dt().item() == pytest.approx(math.log1p(math.exp(mod.dt.raw.item())), rel=1e-5)


@pytest.mark.parametrize("cls", INTEGRATORS)
@pytest.mark.parametrize("raw", [-5.0, -30.0, -80.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dt_stays_positive(cls, raw, dtype):
    mod = cls(head_dim=4, hidden=4).to(dtype)
    with torch.no_grad():
        mod.dt.raw.fill_(raw)
    dt = mod.dt()
    assert dt.item() > 0
    q, k = torch.randn(3, 4, 4, dtype=dtype), torch.randn(3, 2, 4, dtype=dtype)
    q2, k2 = mod(q, k)
    assert torch.isfinite(q2).all() and torch.isfinite(k2).all()


@pytest.mark.parametrize("dt_init", [0.0, -0.1])
def test_nonpositive_dt_init_rejected(dt_init):
    with pytest.raises(ValueError):
        C.EulerCoupling(head_dim=4, hidden=4, dt_init=dt_init)


@pytest.mark.parametrize("cls", INTEGRATORS)
@pytest.mark.parametrize("hq,hk", HEADS)
def test_gradients_reach_dt_and_f(cls, hq, hk):
    mod = make_integrator(cls, steps=2)
    q, k = _randn(4, 2, hq, 6, seed=70), _randn(4, 2, hk, 6, seed=71)
    wq, wk = _randn(*q.shape, seed=72), _randn(*k.shape, seed=73)
    q2, k2 = mod(q, k)
    ((q2 * wq).sum() + (k2 * wk).sum()).backward()
    assert mod.dt.raw.grad is not None and mod.dt.raw.grad.abs().item() > 0
    names = [n for n, _ in mod.named_parameters() if not n.startswith("dt.")]
    assert names, "no MLP parameters"
    for name, p in mod.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name


# ---------------------------------------------------------------------------------------
# 6. parameter counts
# ---------------------------------------------------------------------------------------


def _count(mod: nn.Module) -> int:
    return sum(p.numel() for p in mod.parameters())


@pytest.mark.parametrize(
    "head_dim,hidden",
    [(4, 2), (4, 3), (8, 5), (16, 7), (64, 128), (64, 129), (128, 255), (3, 1001)],
)
def test_mlp_only_parameter_count_matches(head_dim, hidden):
    n_mlp = _count(C.MLPOnlyCoupling(head_dim=head_dim, hidden=hidden))
    n_eul = _count(C.EulerCoupling(head_dim=head_dim, hidden=hidden))
    n_ham = _count(C.HamiltonianCoupling(head_dim=head_dim, hidden=hidden))
    assert n_mlp == n_eul == n_ham
    # f: head_dim -> hidden -> head_dim, plus the scalar dt
    assert n_eul >= head_dim * hidden * 2 + 1


def test_mlp_only_rejects_unsplittable_hidden():
    with pytest.raises(ValueError):
        C.MLPOnlyCoupling(head_dim=4, hidden=1)


# ---------------------------------------------------------------------------------------
# 7. invertible coupling
# ---------------------------------------------------------------------------------------


def make_invertible(layers=2, head_dim=6, hidden=10, scale_bound=2.0, std=0.3, seed=0):
    torch.manual_seed(seed)
    mod = C.InvertibleCoupling(
        head_dim=head_dim, hidden=hidden, layers=layers, scale_bound=scale_bound
    ).double()
    if std:
        perturb_(mod, std, seed=seed + 1)
    return mod


def ref_invertible(mod: C.InvertibleCoupling, q, k):
    """Spec reference: s and t are the two halves of each net's output (s first)."""
    b = mod.scale_bound
    hq, hk = q.shape[-2], k.shape[-2]
    logdet = torch.zeros(q.shape[:-2], dtype=q.dtype)
    for q_net, k_net in zip(mod.q_nets, mod.k_nets, strict=True):
        s1, t1 = q_net(ref_expand(k, hq)).chunk(2, dim=-1)
        s1 = b * torch.tanh(s1 / b)
        q = q * torch.exp(s1) + t1
        s2, t2 = k_net(q).chunk(2, dim=-1)
        s2 = ref_group_mean(b * torch.tanh(s2 / b), hk)
        t2 = ref_group_mean(t2, hk)
        k = k * torch.exp(s2) + t2
        logdet = logdet + s1.sum((-2, -1)) + s2.sum((-2, -1))
    return q, k, logdet


@pytest.mark.parametrize("hq,hk", HEADS)
@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_invertible_identity_at_init(hq, hk, layers, dtype):
    torch.manual_seed(layers)
    mod = C.InvertibleCoupling(head_dim=6, hidden=10, layers=layers).to(dtype)
    q, k = _randn(5, 2, hq, 6, seed=80, dtype=dtype), _randn(5, 2, hk, 6, seed=81, dtype=dtype)
    q2, k2, logdet = mod.forward_with_logdet(q, k)
    assert torch.equal(q2, q) and torch.equal(k2, k)
    assert logdet.shape == (5, 2)
    assert torch.equal(logdet, torch.zeros_like(logdet))
    q3, k3 = mod(q, k)
    assert torch.equal(q3, q) and torch.equal(k3, k)
    qi, ki = mod.inverse(q, k)
    assert torch.equal(qi, q) and torch.equal(ki, k)


@pytest.mark.parametrize("hq,hk", HEADS)
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_invertible_matches_reference(hq, hk, layers):
    mod = make_invertible(layers=layers, std=0.4, seed=layers)
    q, k = _randn(5, 2, hq, 6, seed=82), _randn(5, 2, hk, 6, seed=83)
    with torch.no_grad():
        q2, k2, logdet = mod.forward_with_logdet(q, k)
        rq, rk, rl = ref_invertible(mod, q, k)
    assert (q2 - q).abs().max() > 1e-2 and (k2 - k).abs().max() > 1e-2
    torch.testing.assert_close(q2, rq, rtol=0, atol=1e-12)
    torch.testing.assert_close(k2, rk, rtol=0, atol=1e-12)
    torch.testing.assert_close(logdet, rl, rtol=0, atol=1e-12)


@pytest.mark.parametrize("hq,hk", HEADS)
@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize(
    "dtype,std",
    # std 0.5 drives |q'| into the hundreds, beyond what float32 resolves to 1e-5
    [(torch.float32, 0.1), (torch.float64, 0.1), (torch.float64, 0.5)],
)
def test_invertible_inverse_roundtrip(hq, hk, layers, dtype, std):
    mod = make_invertible(layers=layers, std=std, seed=7).to(dtype)
    q, k = _randn(5, 2, hq, 6, seed=84, dtype=dtype), _randn(5, 2, hk, 6, seed=85, dtype=dtype)
    with torch.no_grad():
        q2, k2 = mod(q, k)
        assert (q2 - q).abs().max() > 1e-3  # not the identity any more
        qb, kb = mod.inverse(q2, k2)
        qf, kf = mod(*mod.inverse(q, k))
    for got, want in ((qb, q), (kb, k), (qf, q), (kf, k)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("hq,hk", [(2, 2), (2, 1), (4, 2)])
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_invertible_logdet_matches_jacobian(hq, hk, layers):
    mod = make_invertible(layers=layers, head_dim=3, hidden=8, std=0.6, seed=11)
    q, k = _randn(hq, 3, seed=90), _randn(hk, 3, seed=91)
    jac = token_jacobian(mod, q, k)
    sign, logabs = torch.linalg.slogdet(jac)
    _, _, logdet = mod.forward_with_logdet(q, k)
    assert logdet.shape == ()
    assert abs(logabs.item()) > 1e-2  # nontrivial volume change
    assert sign.item() > 0
    assert abs(logdet.item() - logabs.item()) < 1e-9


def test_invertible_logdet_per_token():
    mod = make_invertible(layers=2, head_dim=3, hidden=8, std=0.6, seed=12)
    q, k = _randn(3, 2, 4, 3, seed=92), _randn(3, 2, 2, 3, seed=93)
    _, _, logdet = mod.forward_with_logdet(q, k)
    assert logdet.shape == (3, 2)
    for s in range(3):
        for b in range(2):
            _, la = torch.linalg.slogdet(token_jacobian(mod, q[s, b], k[s, b]))
            assert abs(logdet[s, b].item() - la.item()) < 1e-9


@pytest.mark.parametrize("bound", [0.5, 2.0])
def test_invertible_log_scale_bounded(bound):
    """With huge weights every per-coordinate log-scale saturates at +-scale_bound."""
    mod = make_invertible(layers=1, head_dim=3, hidden=8, scale_bound=bound, std=0.0, seed=13)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(_randn(*p.shape, seed=p.numel()) * 50)
    q, k = _randn(2, 3, seed=94), _randn(2, 3, seed=95)
    jac = token_jacobian(mod, q, k)
    # q' = q exp(s1(k)) + t1(k): dq'/dq is diagonal with entries exp(s1)
    log_diag = torch.diagonal(jac[:6, :6]).log()
    assert (log_diag.abs() <= bound + 1e-12).all()
    assert log_diag.abs().max() > 0.9 * bound


def test_invertible_bad_options_rejected():
    with pytest.raises(ValueError):
        C.InvertibleCoupling(head_dim=4, hidden=4, layers=0)
    with pytest.raises(ValueError):
        C.InvertibleCoupling(head_dim=4, hidden=4, scale_bound=0.0)


def test_invertible_gradients():
    mod = make_invertible(layers=2, std=0.2, seed=14)
    q, k = _randn(4, 4, 6, seed=96), _randn(4, 2, 6, seed=97)
    q2, k2, logdet = mod.forward_with_logdet(q, k)
    (q2.square().sum() + k2.sum() + logdet.sum()).backward()
    for name, p in mod.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, name


# ---------------------------------------------------------------------------------------
# 8. build_coupling
# ---------------------------------------------------------------------------------------

BUILD_OPTIONS = {
    "euler": dict(hidden=6, steps=2, dt_init=0.2),
    "hamiltonian": dict(hidden=6, steps=2, dt_init=0.2),
    "mlp_only": dict(hidden=6, steps=2, dt_init=0.2),
    "invertible": dict(hidden=6, layers=2, scale_bound=1.5),
}


def test_coupling_kinds_complete():
    assert set(V.COUPLINGS) == {"none", "euler", "hamiltonian", "mlp_only", "invertible"}
    classes = {name: V.coupling(name).module_class() for name in V.COUPLINGS}
    assert classes == {
        "none": None,
        "euler": C.EulerCoupling,
        "hamiltonian": C.HamiltonianCoupling,
        "mlp_only": C.MLPOnlyCoupling,
        "invertible": C.InvertibleCoupling,
    }


@pytest.mark.parametrize("kind", list(V.COUPLINGS))
def test_build_every_kind(kind):
    if kind == "none":
        assert V.build_coupling("none", 8) is None
        return
    mod = V.build_coupling(kind, 8, **BUILD_OPTIONS[kind])
    assert isinstance(mod, C.QKCoupling)
    assert isinstance(mod, V.coupling(kind).module_class())
    q, k = torch.randn(3, 2, 4, 8), torch.randn(3, 2, 2, 8)
    q2, k2 = mod(q, k)
    assert q2.shape == q.shape and k2.shape == k.shape
    assert torch.isfinite(q2).all() and torch.isfinite(k2).all()
    if kind != "invertible":
        assert mod.steps == 2
        assert mod.dt().item() == pytest.approx(0.2, rel=1e-5)
    else:
        assert len(mod.q_nets) == 2 and mod.scale_bound == 1.5


@pytest.mark.parametrize("kind", ["", "Euler", "leapfrog", "diff", "None"])
def test_build_unknown_kind(kind):
    with pytest.raises(ValueError) as err:
        V.build_coupling(kind, 8, hidden=4)
    msg = str(err.value)
    for choice in V.COUPLINGS:
        assert choice in msg


# ---------------------------------------------------------------------------------------
# 9. Differential Attention
# ---------------------------------------------------------------------------------------


def sdpa_attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def ref_differential(mod: C.DifferentialScoring, q, k, v, layer_index, eps=1e-5):
    """Explicit Differential Attention from the formula; q [b,H,s,d], k/v [b,Hk,s,d]."""
    b, heads, s, d = q.shape
    kv_heads = k.shape[1]
    group = (heads // 2) // (kv_heads // 2)
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * layer_index)
    lam = (
        torch.exp((mod.lambda_q1 * mod.lambda_k1).sum())
        - torch.exp((mod.lambda_q2 * mod.lambda_k2).sum())
        + lam_init
    )
    causal = torch.ones(s, s, dtype=torch.bool).tril()

    def softmax_map(qq, kk):
        scores = qq @ kk.transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(~causal, float("-inf"))
        return torch.softmax(scores, dim=-1)

    outs = []
    for i in range(heads // 2):
        j = i // group
        vv = torch.cat([v[:, 2 * j], v[:, 2 * j + 1]], dim=-1)  # [b, s, 2d]
        a1 = softmax_map(q[:, 2 * i], k[:, 2 * j])
        a2 = softmax_map(q[:, 2 * i + 1], k[:, 2 * j + 1])
        o = a1 @ vv - lam * (a2 @ vv)
        o = o / torch.sqrt(o.square().mean(-1, keepdim=True) + eps) * mod.subln.weight
        outs.append((1 - lam_init) * o)
    return torch.stack(outs, dim=1)


def make_diff(head_dim, layer_index, seed):
    torch.manual_seed(seed)
    mod = C.DifferentialScoring(head_dim=head_dim, layer_index=layer_index).double()
    with torch.no_grad():
        for p in (mod.lambda_q1, mod.lambda_k1, mod.lambda_q2, mod.lambda_k2):
            p.copy_(torch.randn(head_dim, dtype=torch.float64) * 0.4)
        mod.subln.weight.copy_(1 + 0.5 * torch.randn(2 * head_dim, dtype=torch.float64))
    return mod


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4), (8, 2), (4, 2)])
@pytest.mark.parametrize("layer_index", [0, 1, 5])
@pytest.mark.parametrize("v_scale", [1.0, 1e-3])
def test_differential_matches_reference(heads, kv_heads, layer_index, v_scale):
    b, s, d = 2, 7, 8
    mod = make_diff(d, layer_index, seed=heads + kv_heads + layer_index)
    q = _randn(b, heads, s, d, seed=100)
    k = _randn(b, kv_heads, s, d, seed=101)
    v = _randn(b, kv_heads, s, d, seed=102, scale=v_scale)  # 1e-3: eps matters
    out = mod(q, k, v, sdpa_attend)
    assert out.shape == (b, heads // 2, s, 2 * d)
    with torch.no_grad():
        ref = ref_differential(mod, q, k, v, layer_index)
    lam = mod.lambda_full().item()
    assert abs(lam - mod.lambda_init) > 1e-2  # lambda is not trivially lambda_init
    torch.testing.assert_close(out, ref.to(out.dtype), rtol=0, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4)])
def test_differential_float32_matches_reference(heads, kv_heads):
    b, s, d = 2, 6, 4
    mod = make_diff(d, 2, seed=3).float()
    q = _randn(b, heads, s, d, seed=110, dtype=torch.float32)
    k = _randn(b, kv_heads, s, d, seed=111, dtype=torch.float32)
    v = _randn(b, kv_heads, s, d, seed=112, dtype=torch.float32)
    out = mod(q, k, v, sdpa_attend)
    assert out.dtype == torch.float32
    with torch.no_grad():
        ref = ref_differential(mod.double(), q.double(), k.double(), v.double(), 2)
    torch.testing.assert_close(out, ref.float(), rtol=0, atol=1e-5)


def test_differential_float64_keeps_precision():
    """A float64 module on float64 inputs must not round through float32 anywhere."""
    mod = make_diff(8, 1, seed=3)
    q, k = _randn(2, 8, 7, 8, seed=1), _randn(2, 4, 7, 8, seed=2)
    v = _randn(2, 4, 7, 8, seed=3)
    with torch.no_grad():
        out = mod(q, k, v, sdpa_attend)
        ref = ref_differential(mod, q, k, v, 1)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


def test_differential_pairing_is_sensitive():
    """Swapping the two value heads of a pair or the two query heads changes the output."""
    mod = make_diff(4, 1, seed=5)
    q, k, v = _randn(1, 4, 5, 4, seed=1), _randn(1, 4, 5, 4, seed=2), _randn(1, 4, 5, 4, seed=3)
    with torch.no_grad():
        out = mod(q, k, v, sdpa_attend)
        swapped_v = mod(q, k, v[:, [1, 0, 2, 3]], sdpa_attend)
        swapped_q = mod(q[:, [1, 0, 2, 3]], k, v, sdpa_attend)
    assert (out - swapped_v).abs().max() > 1e-3
    assert (out - swapped_q).abs().max() > 1e-3


@pytest.mark.parametrize(
    "layer_index,expected", [(0, 0.2), (1, 0.3555090846), (5, 0.6661219039), (30, 0.7999259)]
)
def test_lambda_init_values(layer_index, expected):
    assert C.differential_lambda_init(layer_index) == pytest.approx(expected, abs=1e-7)
    assert C.differential_lambda_init(layer_index) == pytest.approx(
        0.8 - 0.6 * math.exp(-0.3 * layer_index), abs=1e-15
    )
    mod = C.DifferentialScoring(head_dim=4, layer_index=layer_index)
    assert mod.lambda_init == pytest.approx(expected, abs=1e-7)


def test_lambda_full_formula():
    mod = make_diff(6, 3, seed=9)
    expected = (
        math.exp(float((mod.lambda_q1 * mod.lambda_k1).sum()))
        - math.exp(float((mod.lambda_q2 * mod.lambda_k2).sum()))
        + (0.8 - 0.6 * math.exp(-0.3 * 3))
    )
    assert mod.lambda_full().item() == pytest.approx(expected, rel=1e-6)


def test_differential_parameters_and_subln():
    mod = C.DifferentialScoring(head_dim=8, layer_index=0)
    shapes = {n: tuple(p.shape) for n, p in mod.named_parameters()}
    assert shapes == {
        "lambda_q1": (8,),
        "lambda_k1": (8,),
        "lambda_q2": (8,),
        "lambda_k2": (8,),
        "subln.weight": (16,),
    }
    assert torch.equal(mod.subln.weight, torch.ones(16))
    assert mod.subln.eps == 1e-5


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4)])
def test_differential_gradients(heads, kv_heads):
    mod = make_diff(4, 1, seed=6)
    q = _randn(2, heads, 5, 4, seed=120).requires_grad_()
    k = _randn(2, kv_heads, 5, 4, seed=121).requires_grad_()
    v = _randn(2, kv_heads, 5, 4, seed=122).requires_grad_()
    out = mod(q, k, v, sdpa_attend)
    (out * _randn(*out.shape, seed=123)).sum().backward()
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "subln.weight"):
        grad = mod.get_parameter(name).grad
        assert grad is not None, name
        assert torch.isfinite(grad).all() and grad.abs().max() > 0, name
    for t in (q, k, v):
        assert t.grad is not None and t.grad.abs().max() > 0


# --- the two forms: paired (two calls, 2d-wide values) and split (four calls) --------------


def sdpa_attend_counting(calls: list):
    def attend(q, k, v):
        calls.append((q.shape[1], k.shape[1], v.shape[-1]))
        return sdpa_attend(q, k, v)

    return attend


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4), (8, 2), (4, 2)])
def test_paired_and_split_forms_equal_reference_with_gradients(heads, kv_heads):
    """Outputs and every gradient (q, k, v, lambdas, subln) of both forms equal the explicit
    formula's, in float64 to 1e-6; the paired form makes two calls with 2d-wide values."""
    b, s, d = 2, 7, 8
    results = {}
    for kernel in (*C.DIFFERENTIAL_KERNELS, "reference"):
        mod = make_diff(d, 2, seed=heads * kv_heads)
        mod.kernel = "paired" if kernel == "reference" else kernel
        q = _randn(b, heads, s, d, seed=200).requires_grad_()
        k = _randn(b, kv_heads, s, d, seed=201).requires_grad_()
        v = _randn(b, kv_heads, s, d, seed=202).requires_grad_()
        calls = []
        if kernel == "reference":
            out = ref_differential(mod, q, k, v, 2)
        else:
            out = mod(q, k, v, sdpa_attend_counting(calls))
        (out * _randn(*out.shape, seed=203)).sum().backward()
        grads = {"q": q.grad, "k": k.grad, "v": v.grad}
        grads.update({n: p.grad for n, p in mod.named_parameters()})
        results[kernel] = (out, grads, calls)
    assert results["paired"][2] == [(heads // 2, kv_heads // 2, 2 * d)] * 2
    assert results["split"][2] == [(heads // 2, kv_heads // 2, d)] * 4
    ref_out, ref_grads, _ = results["reference"]
    for kernel in C.DIFFERENTIAL_KERNELS:
        out, grads, _ = results[kernel]
        torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
        assert set(grads) == set(ref_grads)
        for name, grad in grads.items():
            assert ref_grads[name].abs().max() > 1e-3, name  # a real gradient to compare
            torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-6, msg=name)


def test_pair_values_puts_value_heads_side_by_side():
    v = _randn(2, 6, 5, 3, seed=7)
    paired = C.pair_values(v)
    assert paired.shape == (2, 3, 5, 6)
    for j in range(3):
        assert torch.equal(paired[:, j], torch.cat([v[:, 2 * j], v[:, 2 * j + 1]], dim=-1))


def test_differential_kernel_is_checked():
    with pytest.raises(ValueError, match="kernel must be one of"):
        C.DifferentialScoring(head_dim=4, layer_index=0, kernel="fused")
    assert C.DifferentialScoring(head_dim=4, layer_index=0).kernel == "paired"
