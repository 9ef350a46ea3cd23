"""Differential attention's two forms in the Megatron layer, and how the form is chosen.

``paired`` (each attention map computed once: two SDPA calls with ``2 head_dim`` values,
or on CPU ``differential.paired_maps``) and ``split`` (four SDPA calls) must give the
same layer, for every coupling, with and without grouped-query attention: outputs and
gradients of every parameter and of the input equal each other and a plain reference
written here (plain_math.py's modules called as themselves, the differential formula with
explicit per-head loops), to 1e-6 in float64. TP=2 against TP=1 for both forms is in
``test_parallel_equivalence.py``; the Hugging Face export in ``test_convert.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _tiny import tiny_config
from megatron.core.transformer.enums import AttnMaskType

from cqk_megatron.bench import variants as bench
from cqk_megatron.config import COUPLINGS, ConfigError, validate
from cqk_megatron.model.attention import differential
from cqk_megatron.model.attention.differential import (
    DifferentialCoreAttention,
    choose_kernel,
    fused_normalize,
    paired_maps,
)
from cqk_megatron.model.attention.sdpa import chosen_sdpa_kernel
from cqk_megatron.model.gpt import build_model
from cqk_megatron.parallel.process_groups import init_single_process
from cqk_megatron.variants import DIFFERENTIAL_NORMS
from cqk_megatron.variants.plain_math import DifferentialScoring

SEQ, BATCH, HIDDEN, HEADS = 12, 2, 64, 8
KV_LAYOUTS = {"mha": 8, "gqa": 4, "gqa4": 2}


@pytest.fixture(scope="module", autouse=True)
def single_process():
    init_single_process()


def tiny(coupling: str, kv_heads: int, kernel: str, *overrides: str):
    return tiny_config(
        f"{coupling}+differential",
        f"attention.differential_kernel={kernel}",
        "attention.dt_init=0.5",
        *overrides,
        hidden=HIDDEN,
        heads=HEADS,
        kv_heads=kv_heads,
        seq=SEQ,
        precision="fp64",
    )


def perturb(module: torch.nn.Module, seed: int) -> None:
    """Move every coupling and differential parameter off its initial value: identity
    couplings, unit RMSNorm weights or zero output layers would hide misplaced terms."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "raw" not in name:  # dt keeps its softplus parameterisation
                param.add_(0.2 * torch.randn(param.shape, generator=generator).to(param.dtype))


# --- a plain reference of the layer ---------------------------------------------------------


def rotate(x, freqs):
    """Megatron's RoPE: x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * freqs.cos() + torch.cat((-x2, x1), dim=-1) * freqs.sin()


def causal_softmax(q, k, scale):
    """``[s, b, d]`` query and key of one head -> ``[b, s, s]`` attention weights."""
    scores = torch.einsum("sbd,tbd->bst", q, k) * scale
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1)


def reference_layer(attention, hidden, freqs):
    """The layer's output from its weights: projections, the coupling module of
    plain_math.py run as itself, RoPE, then differential attention head by head."""
    heads, groups = (
        attention.num_attention_heads_per_partition,
        attention.num_query_groups_per_partition,
    )
    group, d = heads // groups, attention.hidden_size_per_attention_head
    mixed = (hidden @ attention.linear_qkv.weight.T).view(SEQ, BATCH, groups, group + 2, d)
    q = mixed[..., :group, :].reshape(SEQ, BATCH, heads, d)
    k, v = mixed[..., group, :], mixed[..., group + 1, :]
    coupling = attention.coupling
    if coupling is not None and attention.coupling_position == "pre_rope":
        q, k = coupling(q, k)
    q, k = rotate(q, freqs), rotate(k, freqs)
    if coupling is not None and attention.coupling_position == "post_rope":
        q, k = coupling(q, k)
    diff = attention.core_attention.differential
    lam = (
        torch.exp((diff.lambda_q1 * diff.lambda_k1).sum())
        - torch.exp((diff.lambda_q2 * diff.lambda_k2).sum())
        + diff.lambda_init
    )
    scale, outputs = 1 / math.sqrt(d), []
    for i in range(heads // 2):
        j = i // group  # the key/value pair that differential query head i reads
        value = torch.cat([v[:, :, 2 * j], v[:, :, 2 * j + 1]], dim=-1)
        a1 = causal_softmax(q[:, :, 2 * i], k[:, :, 2 * j], scale)
        a2 = causal_softmax(q[:, :, 2 * i + 1], k[:, :, 2 * j + 1], scale)
        out = torch.einsum("bst,tbd->sbd", a1 - lam * a2, value)
        if diff.subln is None:  # attention.differential_norm=none
            outputs.append(out)
            continue
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + diff.subln.eps)
        outputs.append(out * diff.subln.weight * (1 - diff.lambda_init))
    return torch.cat(outputs, dim=-1) @ attention.linear_proj.weight.T


def output_and_grads(attention, hidden, forward) -> tuple[torch.Tensor, dict]:
    attention.zero_grad(set_to_none=True)
    hidden = hidden.detach().clone().requires_grad_()
    out = forward(hidden)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in attention.named_parameters()}
    return out.detach(), {"input": hidden.grad, **grads}


FORM_CASES = [(coupling, kv, "paper") for coupling in COUPLINGS for kv in KV_LAYOUTS] + [
    (coupling, "gqa", norm)
    for coupling in ("none", "hamiltonian")
    for norm in DIFFERENTIAL_NORMS
    if norm != "paper"
]


@pytest.mark.parametrize("coupling,kv,norm", FORM_CASES)
def test_paired_equals_split_equals_reference(coupling, kv, norm):
    models = {}
    for kernel in ("paired", "split"):
        torch.manual_seed(0)
        setting = f"attention.differential_norm={norm}"
        models[kernel] = build_model(tiny(coupling, KV_LAYOUTS[kv], kernel, setting))
    attention = models["paired"].decoder.layers[1].self_attention
    perturb(attention.core_attention, seed=1)
    if attention.coupling is not None:
        perturb(attention.coupling, seed=2)
    models["split"].load_state_dict(models["paired"].state_dict())
    hidden = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    freqs = models["paired"].rotary_pos_emb(SEQ)
    results = {}
    for kernel, model in models.items():
        layer = model.decoder.layers[1].self_attention
        assert layer.core_attention.kernel == kernel
        results[kernel] = output_and_grads(
            layer, hidden, lambda x, layer=layer: layer(x, None, rotary_pos_emb=freqs)[0]
        )
    assert models["paired"].decoder.layers[1].self_attention.core_attention.last_path == "maps"
    results["reference"] = output_and_grads(
        attention, hidden, lambda x: reference_layer(attention, x, freqs)
    )
    ref_out, ref_grads = results["reference"]
    # without the paper's norm the output is smaller (what the setting is for); float64
    # forms agree far below the tolerance either way
    assert ref_out.std() > (1e-2 if norm == "paper" else 2e-3)
    for kernel in ("paired", "split"):
        out, grads = results[kernel]
        torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6, msg=kernel)
        assert set(grads) == set(ref_grads)
        for name, grad in grads.items():
            assert ref_grads[name].abs().max() > 1e-6, name  # every parameter is used
            torch.testing.assert_close(
                grad, ref_grads[name], rtol=1e-6, atol=1e-6, msg=f"{kernel} {name}"
            )


@pytest.mark.parametrize("norm", DIFFERENTIAL_NORMS)
@pytest.mark.parametrize("kv", ["mha", "gqa"])
def test_paired_sdpa_path_with_a_mask_equals_the_maps_path(kv, norm, monkeypatch):
    """With an explicit mask the paired form runs its two SDPA calls (the math path on
    CPU), not ``paired_maps``; a causal mask must give the causal result, with each norm."""
    torch.manual_seed(0)
    setting = f"attention.differential_norm={norm}"
    model = build_model(tiny("none", KV_LAYOUTS[kv], "paired", setting))
    core = model.decoder.layers[0].self_attention.core_attention
    perturb(core, seed=3)
    kv_heads = KV_LAYOUTS[kv]
    query = torch.randn(SEQ, BATCH, HEADS, HIDDEN // HEADS, dtype=torch.float64)
    key, value = (
        torch.randn(SEQ, BATCH, kv_heads, HIDDEN // HEADS, dtype=torch.float64) for _ in "kv"
    )
    causal = core(query, key, value, None)
    assert core.last_path == "maps"
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F,
        "scaled_dot_product_attention",
        lambda *a, **kw: calls.append(a[2].shape) or sdpa(*a, **kw),
    )
    future = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]  # True: masked out
    masked = core(query, key, value, future, attn_mask_type=AttnMaskType.padding)
    assert core.last_path == "sdpa"
    assert [shape[-1] for shape in calls] == [2 * HIDDEN // HEADS] * 2
    torch.testing.assert_close(masked, causal, rtol=1e-10, atol=1e-10)


def test_split_makes_four_calls_paired_none_on_cpu(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F,
        "scaled_dot_product_attention",
        lambda *a, **kw: calls.append(a[2].shape) or sdpa(*a, **kw),
    )
    tokens = torch.randint(0, 128, (BATCH, SEQ))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    for kernel, expected in (("split", 4 * 2), ("paired", 0)):
        calls.clear()
        model = build_model(tiny("hamiltonian", 4, kernel))
        model(tokens, positions, None)
        assert len(calls) == expected, kernel


# --- the CPU kernel and the fused normalisation ----------------------------------------------


@pytest.mark.parametrize("seq,block", [(7, 128), (300, 128), (300, 64), (9, 4), (8, 4)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4), (8, 2)])
def test_paired_maps_equals_two_sdpa_calls(seq, block, heads, kv_heads):
    """Blocks of query rows (one block, several, a ragged last one) and query groups."""
    generator = torch.Generator().manual_seed(seq + heads)
    d = 8

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    q, k, v = randn(2, heads, seq, d), randn(2, kv_heads, seq, d), randn(2, kv_heads, seq, d)
    lam = torch.tensor(0.37, dtype=torch.float64, requires_grad=True)
    mod = DifferentialScoring(d, 0, kernel="paired").double()

    def two_calls():
        def attend(q_, k_, v_):
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True)

        out1, out2 = mod.attend_maps(q, k, v, attend)
        return out1 - lam * out2

    results = []
    for forward in (two_calls, lambda: paired_maps(q, k, v, lam, 1 / math.sqrt(d), block)):
        for t in (q, k, v, lam):
            t.grad = None
        out = forward()
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        results.append([out, *(t.grad.clone() for t in (q, k, v, lam))])
    for expected, actual in zip(*results, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-9)


def test_paired_maps_backward_passes_gradcheck():
    """The written-out backward against finite differences: three blocks, a ragged one."""
    generator = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(1, heads, 7, 4, generator=generator, dtype=torch.float64).requires_grad_()
        for heads in (4, 2, 2)
    )
    lam = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *x: paired_maps(*x, 0.5, 3), (q, k, v, lam))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_paired_maps_in_lower_precision(dtype, tol):
    generator = torch.Generator().manual_seed(6)
    full = [torch.randn(2, h, 200, 16, generator=generator, dtype=torch.float64) for h in (8, 4, 4)]
    lam = torch.tensor(0.4, dtype=torch.float64)
    results = []
    for precision in (torch.float64, dtype):
        inputs = [t.clone().to(precision).requires_grad_() for t in full]
        out = paired_maps(*inputs, lam.to(precision), 0.25, 64)
        out.float().square().sum().backward()
        results.append([out.double(), *(t.grad.double() for t in inputs)])
    for expected, actual in zip(*results, strict=True):
        scale = expected.abs().max()
        assert (actual - expected).abs().max() <= tol * scale


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_fused_normalize_equals_the_reference(dtype, tol):
    mod = DifferentialScoring(8, 3).to(dtype)
    with torch.no_grad():
        mod.subln.weight.add_(torch.linspace(-0.5, 0.5, 16, dtype=dtype))
    diff = torch.randn(2, 3, 5, 16, dtype=dtype, requires_grad=True)
    results = []
    for normalize in (mod.normalize, lambda x: fused_normalize(mod, x)):
        diff.grad = mod.subln.weight.grad = None
        out = normalize(diff)
        (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum().backward()
        results.append((out, diff.grad.clone(), mod.subln.weight.grad.clone()))
    for expected, actual in zip(*results, strict=True):
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# --- choosing the form ---------------------------------------------------------------------


def never_asked() -> str:
    raise AssertionError("the SDPA probe must not be asked")


CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(
    "setting,transformer_impl,device,probe,cpu_maps,expected",
    [
        ("paired", "local", CUDA, never_asked, True, "paired"),
        ("split", "transformer_engine", CUDA, never_asked, True, "split"),
        ("auto", "transformer_engine", CUDA, never_asked, True, "paired"),
        ("auto", "local", CPU, never_asked, True, "paired"),  # paired_maps
        ("auto", "local", CPU, lambda: "math", False, "split"),  # dropout: no paired_maps
        ("auto", "local", CUDA, lambda: "cudnn", True, "paired"),
        ("auto", "local", CUDA, lambda: "flash", True, "paired"),
        ("auto", "local", CUDA, lambda: "efficient", True, "split"),
        ("auto", "local", CUDA, lambda: "math", True, "split"),
    ],
)
def test_choose_kernel(setting, transformer_impl, device, probe, cpu_maps, expected):
    kernel, reason = choose_kernel(setting, transformer_impl, device, probe, cpu_maps=cpu_maps)
    assert kernel == expected
    assert reason


def test_unknown_kernel_setting_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="attention.differential_kernel='fast'"):
        choose_kernel("fast", "local", CPU, never_asked)
    with pytest.raises(ConfigError, match="attention.differential_kernel='fast' is unknown"):
        validate(tiny("none", 4, "fast"))


def test_chosen_sdpa_kernel_asks_torchs_dispatcher_on_cpu():
    """PyTorch's CPU flash kernel takes only values as wide as queries
    (sdp_utils_cpp.cpp, check_head_dim_size_cpp); anything else is the math path."""
    q = torch.zeros(1, 4, 16, 8, requires_grad=True)
    narrow, wide = torch.zeros(1, 2, 16, 8), torch.zeros(1, 2, 16, 16)
    assert chosen_sdpa_kernel(q, narrow, narrow) == "flash"  # GQA 4 / 2
    assert chosen_sdpa_kernel(q, narrow, wide) == "math"
    assert chosen_sdpa_kernel(q, narrow, narrow, dropout_p=0.1) == "math"


def test_layers_report_their_form_once(capsys, monkeypatch):
    monkeypatch.setattr(differential, "_REPORTED", set())
    build_model(tiny("none", 4, "auto"))
    build_model(tiny("none", 4, "split"))
    lines = [line for line in capsys.readouterr().out.splitlines() if "differential" in line]
    assert lines == [
        "differential attention: paired form (block-causal maps on CPU)",
        "differential attention: split form (attention.differential_kernel)",
    ]


def test_dropout_makes_auto_split_on_cpu():
    model = build_model(tiny("none", 4, "auto", "model.attention_dropout=0.1"))
    core = model.decoder.layers[0].self_attention.core_attention
    assert isinstance(core, DifferentialCoreAttention)
    assert (core.kernel, core.maps) == ("split", False)


# --- the benchmark's @paired / @split tags ------------------------------------------------


def test_bench_tags_choose_the_differential_form():
    config = bench.load_bench_config("tiny")
    for variant, kernel in [
        ("differential@paired", "paired"),
        ("differential@split", "split"),
        ("coupled_differential@paired", "paired"),
        ("invertible_differential@split@recompute", "split"),
        ("differential", "auto"),
    ]:
        assert bench.variant_of(config, variant).attention.differential_kernel == kernel
    assert bench.split_variant("coupled_differential@split@compiled") == (
        "coupled_differential",
        ["split", "compiled"],
    )
    with pytest.raises(ValueError, match="standard scoring"):
        bench.split_variant("coupled@paired")
    for bad in ("differential@paired@split", "differential@split@split"):
        with pytest.raises(ValueError, match="at most one of paired/split"):
            bench.split_variant(bad)


def test_bench_runs_both_forms_side_by_side():
    config = bench.load_bench_config("tiny", ["model.seq_length=64", "model.hidden_size=128"])
    variants = ["standard", "differential@paired", "differential@split"]
    result = bench.run_benchmark(
        config, variants, rounds=1, warmup=0, micro_batch=1, attention_only=True
    )
    rows = {row["variant"]: row for row in result["rows"]}
    assert list(rows) == variants
    assert (rows["standard"]["differential_kernel"], rows["standard"]["sdpa_kernels"]) == (
        None,
        ["flash"],
    )
    assert rows["differential@paired"]["differential_kernel"] == "paired"
    assert rows["differential@paired"]["sdpa_kernels"] == ["maps"]
    assert rows["differential@split"]["differential_kernel"] == "split"
    assert rows["differential@split"]["sdpa_kernels"] == ["flash"]
    report = bench.format_report(result)
    assert "paired:maps" in report and "split:flash" in report


def test_bench_reference_tag_runs_the_plain_module(monkeypatch):
    """differential@split@reference: DifferentialScoring's own forward (four SDPA calls,
    the unfused combination), the reference row of docs/performance.md's kernel table."""
    config = bench.variant_of(bench.load_bench_config("tiny"), "differential@split@reference")
    model = build_model(config)
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert all(core.reference and core.kernel == "split" for core in cores)
    called = []
    monkeypatch.setattr(
        DifferentialScoring, "normalize", lambda self, diff: called.append(1) or diff
    )
    tokens = torch.randint(0, 128, (1, 16))
    model(tokens, torch.arange(16)[None], None)
    assert len(called) == len(cores)


# --- the whole model against the independent plain-PyTorch model ------------------------------


@pytest.mark.parametrize("norm", DIFFERENTIAL_NORMS)
@pytest.mark.parametrize("coupling", ["none", "hamiltonian", "invertible"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_megatron_differential_model_equals_the_plain_model(coupling, kv_heads, norm):
    """``eval/plain_model.py`` writes Differential Attention out from the paper's formula
    (explicit maps, its own pairing and lambda). On identical weights, perturbed so that
    lambda and the sub-layer norm matter, the Megatron model's logits and every gradient
    equal the plain model's in float64: whatever the training runs show, this
    implementation computes the formula, with each ``attention.differential_norm``."""
    from test_plain_reference import VOCAB, compare

    config = validate(
        tiny_config(
            f"{coupling}+differential",
            "model.make_vocab_size_divisible_by=8",
            f"attention.differential_norm={norm}",
            vocab=VOCAB,
            hidden=32,
            heads=4,
            kv_heads=kv_heads,
            seq=12,
            precision="fp64",
        )
    )
    logit_error, grad_errors, expected = compare(config)
    assert expected.std() > 0.1
    assert logit_error < 1e-9
    worst = max(grad_errors, key=grad_errors.get)
    assert grad_errors[worst] < 1e-9, (worst, grad_errors[worst])
    assert any(".differential.lambda_q2" in name for name in grad_errors)
    # the norm's weight is compared where it exists, and only there
    assert any(".differential.subln.weight" in name for name in grad_errors) == (norm != "none")


@pytest.mark.parametrize("norm", ["paper", "none"])
def test_a_constant_lambda_init_equals_the_plain_model(norm):
    """``attention.differential_lambda_init``: one lambda_init in every layer (lambda's
    constant term and the paper's ``1 - lambda_init`` factor), in both implementations."""
    from test_plain_reference import VOCAB, compare

    config = validate(
        tiny_config(
            "coupled_differential",
            "model.make_vocab_size_divisible_by=8",
            f"attention.differential_norm={norm}",
            "attention.differential_lambda_init=0.5",
            vocab=VOCAB,
            hidden=32,
            heads=4,
            kv_heads=2,
            seq=12,
            precision="fp64",
        )
    )
    model = build_model(config)
    assert {m.lambda_init for m in scorings_of(model)} == {0.5}
    logit_error, grad_errors, _ = compare(config)
    assert logit_error < 1e-9
    assert max(grad_errors.values()) < 1e-9


def test_lambda_init_out_of_range_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"attention.differential_lambda_init=1.0 must lie in"):
        validate(tiny("none", 4, "auto", "attention.differential_lambda_init=1.0"))
    with pytest.raises(ValueError, match="lambda_init must lie in"):
        DifferentialScoring(8, 0, lambda_init=-0.1)
    config = tiny_config("coupled", "attention.differential_lambda_init=0.5")
    with pytest.raises(ConfigError, match="applies to scoring 'differential' only"):
        validate(config)


# --- attention.differential_norm ------------------------------------------------------------


def scorings_of(model) -> list[DifferentialScoring]:
    return [m for m in model.modules() if isinstance(m, DifferentialScoring)]


@pytest.mark.parametrize("variant", ["differential", "coupled_differential"])
def test_differential_norm_builds_what_it_names(variant):
    """``paper``: the norm's weight starts at 1; ``small_start``: at SMALL_START_WEIGHT (the
    plain model's own 0.1 too); ``none``: no norm at all. The parameter count the planner
    uses (the registry's, on the math module) is the built model's."""
    from cqk_megatron.eval.mqar_models import plain_config_for
    from cqk_megatron.eval.plain_model import PlainLM
    from cqk_megatron.model.params import total_parameters
    from cqk_megatron.variants.plain_math import SMALL_START_WEIGHT

    starts = {"paper": 1.0, "small_start": SMALL_START_WEIGHT, "none": None}
    for norm, start in starts.items():
        config = validate(tiny("none", 4, "auto", f"attention.differential_norm={norm}"))
        config.attention.coupling = VARIANT_COUPLINGS[variant]
        model = build_model(config)
        layers = scorings_of(model)
        assert len(layers) == config.model.num_layers
        plain = PlainLM(plain_config_for(config))
        plain_norms = [b.attn.differential.subln for b in plain.blocks]
        if start is None:
            assert all(m.subln is None for m in layers) and set(plain_norms) == {None}
        else:
            for weight in [m.subln.weight for m in layers] + [n.weight for n in plain_norms]:
                # built in fp32, then cast to the model's fp64
                assert torch.allclose(weight, torch.full_like(weight, start), rtol=1e-7), norm
        assert total_parameters(config) == sum(p.numel() for p in model.parameters()), norm


VARIANT_COUPLINGS = {"differential": "none", "coupled_differential": "hamiltonian"}


def test_differential_norm_on_standard_scoring_is_refused_in_one_line():
    """The setting belongs to the differential scoring: on another it would change nothing,
    so a sweep that sets it for standard attention is refused, naming the field."""
    config = tiny_config("coupled", "attention.differential_norm=none")
    with pytest.raises(ConfigError) as error:
        validate(config)
    lines = [line for line in str(error.value).splitlines() if "differential_norm" in line]
    assert lines == [
        "  - attention.differential_norm='none' applies to scoring 'differential' only, not "
        "attention.scoring='standard'; remove it or choose a differential variant"
    ]
    validate(tiny_config("coupled", "attention.differential_norm=paper"))  # the default


def test_unknown_differential_norm_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"attention.differential_norm='rms' is unknown; choose"):
        validate(tiny("none", 4, "auto", "attention.differential_norm=rms"))
    with pytest.raises(ValueError, match="norm must be one of"):
        DifferentialScoring(8, 0, norm="rms")


@pytest.mark.parametrize("norm", DIFFERENTIAL_NORMS)
def test_mqar_plain_model_takes_differential_scoring(norm):
    """``cqk mqar --model plain`` builds the plain model of a differential variant (its
    norm through ``--plain``), the same function as the Megatron model of that variant."""
    from cqk_megatron.eval.mqar import MQARSetting, TrainOptions
    from cqk_megatron.eval.mqar_train import build, plain_config

    options = TrainOptions(model="plain", plain={"differential_norm": norm})
    config = plain_config("coupled_differential", MQARSetting(64, 4), options)
    assert (config.scoring, config.coupling, config.differential_norm) == (
        "differential",
        "hamiltonian",
        norm,
    )
    model = build("differential", MQARSetting(64, 4), options)
    assert len([b for b in model.blocks if b.attn.differential is not None]) == len(model.blocks)


@pytest.mark.parametrize("norm", ["paper", "none"])
def test_megatron_and_plain_models_train_alike_on_the_same_batches(norm):
    """``eval/plain_curves.py``: from the same weights, on the same batches, with the same
    schedule and AdamW, the two models' validation curves agree (fp64, a tiny
    coupled_differential model on a synthetic progression task)."""
    from _synthetic import ProgressionDataset

    from cqk_megatron.eval.plain_curves import paired_curves

    config = validate(
        tiny_config(
            "coupled_differential",
            "model.make_vocab_size_divisible_by=8",
            f"attention.differential_norm={norm}",
            "train.train_steps=6",
            "train.eval_interval=2",
            "train.eval_iters=1",
            "train.schedule.warmup_steps=2",
            "train.optimizer.lr=0.01",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            vocab=64,
            hidden=32,
            heads=4,
            kv_heads=2,
            seq=12,
            precision="fp64",
        )
    )
    m = config.model
    datasets = (ProgressionDataset(64, m.seq_length), ProgressionDataset(64, m.seq_length, seed=1))
    curve = paired_curves(config, datasets)
    assert [step for step, *_ in curve] == [2, 4, 6]
    assert curve[-1][1] < curve[0][1] - 0.05  # it learns
    # Megatron's cross-entropy runs in fp32 whatever the model's dtype
    # (tensor_parallel/cross_entropy.py: logits.float()), hence 1e-6 and not 1e-9
    for step, megatron, plain in curve:
        assert abs(plain - megatron) < 1e-6 * abs(megatron), (step, megatron, plain)
