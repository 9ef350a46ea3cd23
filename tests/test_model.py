"""Single-process checks of the Megatron model: parameter overheads, spec composition,
the attention layers against formulas written here, identity-initialised coupling."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from _tiny import tiny_config

from cqk_megatron.bench.overhead import format_table, overhead_table
from cqk_megatron.compat import cpu_bridge
from cqk_megatron.config import CONFIGS_DIR, COUPLINGS, SCORINGS, VARIANTS, load_config
from cqk_megatron.model.attention import (
    DifferentialCoreAttention,
    QKSelfAttention,
    SDPACoreAttention,
)
from cqk_megatron.model.gpt import build_model
from cqk_megatron.parallel.process_groups import init_single_process
from cqk_megatron.variants.plain_math import (
    EulerCoupling,
    HamiltonianCoupling,
    InvertibleCoupling,
    MLPOnlyCoupling,
)

# The classes each shipped name must build, written out here (not read from the registry).
COUPLING_CLASSES = {
    "none": None,
    "euler": EulerCoupling,
    "hamiltonian": HamiltonianCoupling,
    "mlp_only": MLPOnlyCoupling,
    "invertible": InvertibleCoupling,
}
SCORING_CLASSES = {"standard": SDPACoreAttention, "differential": DifferentialCoreAttention}

SEQ, BATCH = 12, 2


@pytest.fixture(scope="module", autouse=True)
def single_process():
    init_single_process()


def tiny(coupling="none", scoring="standard", *overrides):
    return tiny_config(f"{coupling}+{scoring}", *overrides, seq=SEQ, precision="fp64")


def build(config, seed=0):
    torch.manual_seed(seed)
    return build_model(config)


def test_coupled_overhead_at_60m(capsys):
    config = load_config(CONFIGS_DIR / "models/60m.yaml")
    rows = {
        r["variant"]: r for r in overhead_table(config, ["coupled", "coupled_euler", "mlp_only"])
    }
    with capsys.disabled():
        print(
            "\n60M parameter overhead over standard attention:\n"
            + format_table(list(rows.values()))
        )
    assert 0.05 <= rows["coupled"]["percent"] <= 0.2
    # the ablation matches the coupled variants' extra parameters exactly
    assert rows["mlp_only"]["extra"] == rows["coupled"]["extra"] == rows["coupled_euler"]["extra"]


def test_invertible_overhead_at_150m(capsys):
    config = load_config(CONFIGS_DIR / "models/150m.yaml")
    rows = overhead_table(config, ["invertible", "invertible_differential"])
    with capsys.disabled():
        print("\n150M parameter overhead over standard attention:\n" + format_table(rows))
    for row in rows:
        assert 0.1 <= row["percent"] <= 0.6


@pytest.mark.parametrize(("coupling", "scoring"), list(itertools.product(COUPLINGS, SCORINGS)))
def test_every_coupling_composes_with_every_scoring(coupling, scoring):
    model = build(tiny(coupling, scoring))
    for layer in model.decoder.layers:
        attention = layer.self_attention
        assert isinstance(attention, QKSelfAttention)
        expected = COUPLING_CLASSES[coupling]
        assert (
            (attention.coupling is None)
            if expected is None
            else type(attention.coupling) is expected
        )
        assert type(attention.core_attention) is SCORING_CLASSES[scoring]


# --- the attention layer against a formula -----------------------------------------------


def rotate(x, freqs):
    """Megatron's RoPE: x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * freqs.cos() + torch.cat((-x2, x1), dim=-1) * freqs.sin()


def hamiltonian_by_hand(coupling, q, k):
    """One leapfrog step, GQA by explicit loops over groups."""
    dt, group = coupling.dt(), q.shape[-2] // k.shape[-2]

    def kick(q_):
        fq = coupling.f(q_)
        return torch.stack(
            [fq[..., j * group : (j + 1) * group, :].mean(-2) for j in range(k.shape[-2])], -2
        )

    k_half = k + dt / 2 * kick(q)
    q_new = q + dt * torch.cat(
        [
            k_half[..., j : j + 1, :].expand(*q.shape[:-2], group, q.shape[-1])
            for j in range(k.shape[-2])
        ],
        dim=-2,
    )
    return q_new, k_half + dt / 2 * kick(q_new)


def causal_softmax(q, k, scale):
    """``[s, b, d]`` query and key of one head -> ``[b, s, s]`` attention weights."""
    scores = torch.einsum("sbd,tbd->bst", q, k) * scale
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1)


def reference_attention(attention, hidden, freqs):
    """The layer's output from its weights, written out head by head."""
    heads, groups = (
        attention.num_attention_heads_per_partition,
        attention.num_query_groups_per_partition,
    )
    group, d = heads // groups, attention.hidden_size_per_attention_head
    mixed = (hidden @ attention.linear_qkv.weight.T).view(SEQ, BATCH, groups, group + 2, d)
    q = mixed[..., :group, :].reshape(SEQ, BATCH, heads, d)
    k, v = mixed[..., group, :], mixed[..., group + 1, :]
    couple = attention.coupling is not None
    if couple and attention.coupling_position == "pre_rope":
        q, k = hamiltonian_by_hand(attention.coupling, q, k)
    q, k = rotate(q, freqs), rotate(k, freqs)
    if couple and attention.coupling_position == "post_rope":
        q, k = hamiltonian_by_hand(attention.coupling, q, k)
    scale = 1 / math.sqrt(d)
    core = attention.core_attention
    outputs = []
    if not hasattr(core, "differential"):
        for h in range(heads):
            weights = causal_softmax(q[:, :, h], k[:, :, h // group], scale)
            outputs.append(torch.einsum("bst,tbd->sbd", weights, v[:, :, h // group]))
    else:
        diff = core.differential
        lam = (
            torch.exp((diff.lambda_q1 * diff.lambda_k1).sum())
            - torch.exp((diff.lambda_q2 * diff.lambda_k2).sum())
            + diff.lambda_init
        )
        for i in range(heads // 2):
            j = i // group  # differential key/value head read by differential query head i
            value = torch.cat([v[:, :, 2 * j], v[:, :, 2 * j + 1]], dim=-1)
            a1 = causal_softmax(q[:, :, 2 * i], k[:, :, 2 * j], scale)
            a2 = causal_softmax(q[:, :, 2 * i + 1], k[:, :, 2 * j + 1], scale)
            out = torch.einsum("bst,tbd->sbd", a1 - lam * a2, value)
            out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + diff.subln.eps)
            outputs.append(out * diff.subln.weight * (1 - diff.lambda_init))
    context = torch.cat(outputs, dim=-1)
    return context @ attention.linear_proj.weight.T


@pytest.mark.parametrize(
    ("coupling", "scoring", "position"),
    [
        ("none", "standard", "pre_rope"),
        ("hamiltonian", "standard", "pre_rope"),
        ("hamiltonian", "standard", "post_rope"),
        ("none", "differential", "pre_rope"),
        ("hamiltonian", "differential", "pre_rope"),
        ("hamiltonian", "differential", "post_rope"),
    ],
)
@pytest.mark.parametrize("kv_groups", [8, 4], ids=["mha", "gqa"])
def test_attention_layer_matches_formula(coupling, scoring, position, kv_groups):
    config = tiny(
        coupling,
        scoring,
        f"attention.position={position}",
        f"model.num_query_groups={kv_groups}",
        "attention.dt_init=0.5",
    )
    model = build(config)
    attention = model.decoder.layers[1].self_attention
    if coupling != "none":  # a non-trivial f, so that a misplaced coupling shows
        torch.nn.init.normal_(attention.coupling.f.fc2.weight, std=0.5)
    hidden = torch.randn(SEQ, BATCH, 64, dtype=torch.float64)
    freqs = model.rotary_pos_emb(SEQ)
    output, _ = attention(hidden, None, rotary_pos_emb=freqs)
    expected = reference_attention(attention, hidden, freqs)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_pre_and_post_rope_coupling_differ():
    outputs = []
    for position in ("pre_rope", "post_rope"):
        model = build(
            tiny(
                "hamiltonian", "standard", f"attention.position={position}", "attention.dt_init=0.5"
            )
        )
        tokens = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        outputs.append(model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None))
    assert (outputs[0] - outputs[1]).abs().max() > 1e-4


@pytest.mark.parametrize("scoring", SCORINGS)
def test_invertible_coupling_is_identity_at_init(scoring):
    """With its zero-initialised output layers the coupled model is the uncoupled one."""
    uncoupled = build(tiny("none", scoring))
    coupled = build(tiny("invertible", scoring), seed=1)
    shared = dict(uncoupled.named_parameters())
    with torch.no_grad():
        for name, param in coupled.named_parameters():
            if ".coupling." not in name:
                param.copy_(shared[name])
    tokens = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    torch.testing.assert_close(
        coupled(tokens, positions, None), uncoupled(tokens, positions, None), rtol=0, atol=1e-6
    )


def test_variants_table_names_valid_pairs():
    for coupling, scoring in VARIANTS.values():
        assert coupling in COUPLINGS and scoring in SCORINGS


def test_cpu_bridge_redirects_only_megatron_modules():
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    cpu_bridge.install()
    cpu_bridge.install()  # idempotent
    assert schedules.torch.zeros([], device="cuda").device.type == "cpu"
    assert (
        p2p_communication.torch.empty(
            (3,), device=p2p_communication.torch.cuda.current_device()
        ).device.type
        == "cpu"
    )
    p2p_communication.torch.cuda.synchronize()  # a no-op instead of a CUDA error
    assert schedules.torch.float32 is torch.float32  # everything else is the real torch
    assert torch.cuda.current_device is not p2p_communication.torch.cuda.current_device
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros([], device="cuda")  # torch itself is untouched
    cpu_bridge.uninstall()
    assert schedules.torch is torch
    cpu_bridge.install()


# (pipeline_parallel, virtual_pipeline, device) -> (batch_p2p_comm, overlap_p2p_comm)
P2P_RULE = [
    (1, None, "cuda", True, False),  # no pipeline: unused, Megatron's default
    (2, None, "cuda", True, False),  # plain 1F1B: Megatron-LM batches
    (4, None, "cuda", True, False),
    (2, 2, "cuda", False, True),  # interleaved: Megatron-LM overlaps, unbatched
    (4, 2, "cuda", False, True),
    (1, None, "cpu", False, False),  # gloo: unbatched, not overlapped
    (2, None, "cpu", False, False),
    (2, 2, "cpu", False, False),
    (4, 2, "cpu", False, False),
]


@pytest.mark.parametrize(("pp", "vp", "device_type", "batch", "overlap"), P2P_RULE)
def test_the_p2p_rule_for_each_layout_and_device(pp, vp, device_type, batch, overlap):
    from cqk_megatron.model.gpt import p2p_options

    options = p2p_options(pp, vp, device_type)
    assert options == {"batch_p2p_comm": batch, "overlap_p2p_comm": overlap}
    assert not (options["batch_p2p_comm"] and options["overlap_p2p_comm"])  # Megatron refuses


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_megatrons_config_takes_the_p2p_rule_for_interleaved_1f1b(monkeypatch, device_type):
    """Megatron's own TransformerConfig accepts what the rule gives (on CPU for this build:
    only the device the rule reads is said to be CUDA)."""
    import cqk_megatron.model.gpt as model

    monkeypatch.setattr(model, "device", lambda: torch.device(device_type))
    config = tiny_config(
        "standard",
        "model.num_layers=4",
        "parallel.pipeline_parallel=2",
        "parallel.virtual_pipeline=2",
    )
    megatron_config = model.transformer_config(config)
    on_gpu = device_type == "cuda"
    assert (megatron_config.batch_p2p_comm, megatron_config.overlap_p2p_comm) == (False, on_gpu)
