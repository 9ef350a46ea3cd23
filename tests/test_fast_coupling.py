"""The fused, compiled and recomputed couplings against the reference of ``plain_math.py``.

``cqk_megatron.model.attention.fast_coupling`` rearranges the math (group means before the
output layer, shared leapfrog kicks, broadcasts instead of copies); every path must give
the reference modules' outputs and gradients (fp32, 1e-5). ``torch.compile`` is slow
on a small CPU, so the compiled path is checked on two integrators and one model; the
eager and recomputed paths on every integrator, step count and grouped-query shape.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _tiny import tiny_config
from torch.func import functional_call, jvp

from cqk_megatron.bench import variants as bench
from cqk_megatron.bench.measure import saved_activation_bytes
from cqk_megatron.model.attention import fast_coupling
from cqk_megatron.model.attention.fast_coupling import fused_coupling, run_coupling
from cqk_megatron.model.gpt import build_model
from cqk_megatron.parallel.process_groups import init_single_process
from cqk_megatron.variants import build_coupling

SEQ, BATCH, HEADS, HEAD_DIM, HIDDEN = 12, 2, 8, 8, 8
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module", autouse=True)
def single_process():
    init_single_process()


def coupling_under_test(kind: str, steps: int, seed: int = 0):
    """A coupling whose every parameter is perturbed (the invertible one starts as the
    identity, and a zero output layer would hide a misplaced term)."""
    options = {"layers": steps} if kind == "invertible" else {"steps": steps, "dt_init": 0.3}
    with torch.random.fork_rng():  # the same initial parameters whatever ran before
        torch.manual_seed(seed)
        coupling = build_coupling(kind, HEAD_DIM, hidden=HIDDEN, **options)
    generator = torch.Generator().manual_seed(seed)
    # Smaller for the invertible maps: their exp scales multiply over layers, and fp32
    # rounding, amplified, would then exceed 1e-5 whichever way the math is arranged.
    scale = 0.1 if kind == "invertible" else 0.2
    with torch.no_grad():
        for name, param in coupling.named_parameters():
            if "raw" not in name:  # keep dt's softplus parameterisation at its init
                param.add_(scale * torch.randn(param.shape, generator=generator))
    return coupling


def inputs(kv_heads: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(SEQ, BATCH, kv_heads, HEAD_DIM, generator=generator)
    return q.requires_grad_(), k.requires_grad_()


def loss_weights(q_out: torch.Tensor, k_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Weights that differ for every output element (fp32, whatever the outputs' dtype:
    an fp64 reference weighs exactly as the fp32 loss does), shaped as the outputs."""
    weights = torch.linspace(-1, 1, q_out.numel() + k_out.numel()).to(q_out.dtype)
    q_w, k_w = weights.split([q_out.numel(), k_out.numel()])
    return q_w.view(q_out.shape), k_w.view(k_out.shape)


def outputs_and_grads(coupling, q, k, couple) -> list[torch.Tensor]:
    """Coupled q, k and the gradients of a loss that weighs every element differently."""
    q_out, k_out = couple(coupling, q, k)
    q_w, k_w = loss_weights(q_out, k_out)
    loss = (q_out * q_w).sum() + (k_out * k_w).sum()
    params = list(coupling.parameters())
    grads = torch.autograd.grad(loss, [q, k, *params])
    return [q_out.detach(), k_out.detach(), *grads]


def reference(coupling, q, k):
    return coupling(q, k)


def assert_same_as_reference(kind, steps, kv_heads, couple):
    coupling = coupling_under_test(kind, steps)
    q, k = inputs(kv_heads)
    expected = outputs_and_grads(coupling, q, k, reference)
    got = outputs_and_grads(coupling, q, k, couple)
    assert len(got) == len(expected)
    for value, want in zip(got, expected, strict=True):
        torch.testing.assert_close(value, want, **TOL)
    assert expected[0].sub(q).abs().max() > 1e-2  # the coupling did move q


KINDS = ("euler", "hamiltonian", "mlp_only", "invertible")
SHAPES = pytest.mark.parametrize("kv_heads", [HEADS, 2], ids=["mha", "gqa4"])


@SHAPES
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_eager_equals_reference(kind, steps, kv_heads):
    assert_same_as_reference(kind, steps, kv_heads, fused_coupling)


@SHAPES
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_recomputed_equals_reference(kind, steps, kv_heads):
    def recomputed(coupling, q, k):
        return run_coupling(coupling, q, k, impl="eager", recompute=True)

    assert_same_as_reference(kind, steps, kv_heads, recomputed)


# Compiling is slow here (inductor's first compile about 30 s with a cold cache): the
# Euler step is compiled here, the leapfrog in the model tests, the others run eagerly.
@pytest.mark.parametrize(("kind", "steps", "kv_heads"), [("euler", 1, 2)])
def test_compiled_equals_reference(kind, steps, kv_heads):
    assert_same_as_reference(
        kind, steps, kv_heads, lambda c, q, k: fused_coupling(c, q, k, compiled=True)
    )


def scalar_gradient_in_fp64(coupling, q, k, name: str) -> tuple[float, float]:
    """The gradient of ``outputs_and_grads``'s loss with respect to the one-element
    parameter ``name``, from the reference module in fp64, and the sum over tokens of the
    magnitudes of each token's term of it (forward mode: each output element's derivative
    with respect to the parameter, weighted as the loss weighs it)."""
    module = copy.deepcopy(coupling).double()
    params = {n: p.detach() for n, p in module.named_parameters()}
    q64, k64 = q.detach().double(), k.detach().double()

    def coupled(value):
        return functional_call(module, {**params, name: value}, (q64, k64))

    _, (dq, dk) = jvp(coupled, (params[name],), (torch.ones_like(params[name]),))
    q_w, k_w = loss_weights(dq, dk)
    per_token = (dq * q_w).sum((-2, -1)) + (dk * k_w).sum((-2, -1))  # [seq, batch]
    return per_token.sum().item(), per_token.abs().sum().item()


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_equals_eager_fp32(kind):
    """What ``coupling_impl=auto`` runs on GPU against what it runs on CPU: the fused form
    through inductor against the same form eagerly, outputs and every gradient within 1e-6
    of the tensor's largest magnitude.

    A one-element gradient (``dt``'s) is one sum over every token of terms of both signs,
    which cancel: the result can be far smaller than its terms, and inductor orders the sum
    its own way. No fp32 summation promises it to 1e-6 of itself, only to about 1e-6 of the
    sum of its terms' magnitudes (a pairwise sum of n terms: log2(n) x 6e-8 of it). So
    eager and compiled are each held to 1e-6 of that sum, against the reference module's
    gradient in fp64, which both approximate."""
    coupling = coupling_under_test(kind, 2)
    q, k = inputs(2)
    eager = outputs_and_grads(coupling, q, k, fused_coupling)
    compiled = outputs_and_grads(
        coupling, q, k, lambda c, q, k: fused_coupling(c, q, k, compiled=True)
    )
    assert fast_coupling._COMPILED  # the compiled path ran
    names = ["q", "k", "grad q", "grad k", *(n for n, _ in coupling.named_parameters())]
    for name, value, want in zip(names, compiled, eager, strict=True):
        if want.numel() > 1:
            assert (value - want).abs().max() <= 1e-6 * want.abs().max(), name
            continue
        exact, magnitude = scalar_gradient_in_fp64(coupling, q, k, name)
        for path, got in (("eager", want), ("compiled", value)):
            error = abs(got.item() - exact)
            assert error <= 1e-6 * magnitude, (
                f"{name} ({path}): {got.item()!r} against {exact!r} in fp64, off by "
                f"{error:.3g}, above 1e-6 of its terms' magnitudes {magnitude:.6g}"
            )


@pytest.mark.parametrize(
    ("impl", "device_type", "expected"),
    [
        ("auto", "cuda", "compiled"),
        ("auto", "cpu", "eager"),
        ("eager", "cuda", "eager"),
        ("compiled", "cpu", "compiled"),
        ("reference", "cuda", "reference"),
    ],
)
def test_auto_compiles_on_gpu_only(impl, device_type, expected):
    coupling = coupling_under_test("hamiltonian", 1)
    assert fast_coupling.resolve_impl(impl, coupling, device_type) == expected


def test_auto_runs_a_coupling_without_fused_form_eagerly():
    class Custom(type(build_coupling("euler", HEAD_DIM, hidden=HIDDEN))):
        pass

    assert fast_coupling.resolve_impl("auto", Custom(HEAD_DIM, HIDDEN), "cuda") == "eager"


def test_recompute_keeps_only_the_inputs():
    """Under recompute the coupling keeps q and k (one storage each here), nothing else."""
    coupling = coupling_under_test("hamiltonian", 2)
    q, k = inputs(2)

    def forward(recompute: bool):
        return lambda: sum(t.sum() for t in run_coupling(coupling, q, k, recompute=recompute))

    stored = saved_activation_bytes(coupling, forward(False))
    recomputed = saved_activation_bytes(coupling, forward(True))
    assert recomputed == (q.numel() + k.numel()) * 4
    assert stored > 3 * recomputed


def test_compile_failure_names_the_config_field():
    def untraceable(q, k):
        torch._dynamo.graph_break()  # fullgraph=True refuses this
        return q, k

    q, k = inputs(HEADS)
    with pytest.raises(RuntimeError, match="attention.coupling_impl=eager"):
        fast_coupling._call_compiled(untraceable, q, k, [], {})


def test_unknown_impl_is_refused():
    coupling = coupling_under_test("euler", 1)
    with pytest.raises(ValueError, match="attention.coupling_impl"):
        run_coupling(coupling, *inputs(HEADS), impl="fast")


# --- a whole Megatron model --------------------------------------------------------------


def tiny(*overrides: str):
    return tiny_config(
        "hamiltonian+standard",
        "attention.steps=2",
        "attention.dt_init=0.3",
        *overrides,
        heads=HEADS,
        seq=SEQ,
    )


def loss_and_grads(config, impl: str | None = None):
    torch.manual_seed(0)
    model = build_model(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".coupling." in name and param.dim() == 2:  # a non-trivial f
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    for layer in model.decoder.layers:
        layer.self_attention.coupling_impl = impl or layer.self_attention.coupling_impl
    tokens = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    loss = model(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, model


@pytest.mark.parametrize(
    "overrides",
    [
        ["attention.coupling_impl=compiled"],
        ["attention.recompute_coupling=true"],
        ["attention.coupling_impl=compiled", "attention.recompute_coupling=true"],
        ["attention.recompute_coupling=true", "attention.position=post_rope"],
    ],
    ids=["compiled", "recompute", "compiled+recompute", "recompute-post-rope"],
)
def test_model_loss_and_gradients_equal_reference(overrides):
    position = [o for o in overrides if o.startswith("attention.position")]
    expected_loss, expected, _ = loss_and_grads(tiny(*position), impl="reference")
    loss, grads, model = loss_and_grads(tiny(*overrides))
    attention = model.decoder.layers[0].self_attention
    assert (attention.coupling_impl, attention.recompute_coupling) == (
        "compiled" if "attention.coupling_impl=compiled" in overrides else "eager",
        "attention.recompute_coupling=true" in overrides,
    )
    torch.testing.assert_close(loss, expected_loss, **TOL)
    assert expected.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], **TOL, msg=name)


def test_recompute_saves_the_coupling_activations_of_a_model():
    """With recompute the coupled model keeps what the standard model keeps, plus the
    coupling's inputs where they are not views of kept tensors: with grouped-query
    attention Megatron's ``q`` is a reshaped copy of the QKV output, ``k`` a view."""
    tokens = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)

    def saved(*overrides: str) -> int:
        torch.manual_seed(0)
        model = build_model(tiny(*overrides))
        return saved_activation_bytes(model, lambda: model(tokens, positions, None, labels=tokens))

    standard = saved("attention.coupling=none")
    stored = saved()
    recomputed = saved("attention.recompute_coupling=true")
    query_bytes = SEQ * BATCH * HEADS * HEAD_DIM * 4
    assert stored > standard + 2 * 3 * query_bytes  # a few q-sized tensors per layer
    assert recomputed == standard + 2 * query_bytes  # two layers


def test_compiled_coupling_without_fused_form_is_refused():
    class Custom(type(build_coupling("euler", HEAD_DIM, hidden=HIDDEN))):
        pass

    assert not fast_coupling.has_fused_form(Custom(HEAD_DIM, HIDDEN))
    with pytest.raises(NotImplementedError, match="fused form"):
        fused_coupling(Custom(HEAD_DIM, HIDDEN), *inputs(HEADS))


# --- the benchmark's variant tags ----------------------------------------------------------


def test_bench_variant_tags_set_the_coupling_impl():
    config = tiny()
    compiled = bench.variant_of(config, "coupled@compiled@recompute").attention
    assert (compiled.coupling, compiled.coupling_impl, compiled.recompute_coupling) == (
        "hamiltonian",
        "compiled",
        True,
    )
    assert bench.variant_of(config, "coupled@reference").attention.coupling_impl == "reference"
    assert bench.variant_of(config, "coupled").attention.coupling_impl == "auto"  # eager on CPU
    for bad in ("coupled@fast", "coupled@eager@compiled", "nonsense@compiled"):
        with pytest.raises(ValueError, match="coupled@compiled@recompute|unknown variant"):
            bench.split_variant(bad)
