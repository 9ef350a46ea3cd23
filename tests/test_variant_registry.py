"""The variant registry: a coupling declared in this file alone runs through the stack, and
a name nothing registered is refused everywhere with the registry's one message.

The toy coupling ``q <- q * (1 + dt)`` (``k`` unchanged, one learnable ``dt`` per layer)
is one class and one ``CouplingVariant``; no other file knows it. It is registered for this
module's tests only (``registered``), in this process and in the spawned tensor-parallel
ranks, which import this module to run ``toy_worker``. It declares a FLOPs term and no
memory term, so the FLOPs estimate works and the memory estimate refuses, naming the term.
"""

from __future__ import annotations

import json

import pytest
import torch
from _equivalence import worker
from _multiproc import run_ranks

from cqk_megatron.config import COUPLINGS, SCORINGS, ConfigError, RunConfig, load_config, validate
from cqk_megatron.convert import ConversionError, export_state_dict
from cqk_megatron.convert.hf_config import check_exportable, run_config_from_cqk
from cqk_megatron.model.gpt import build_model, count_parameters
from cqk_megatron.model.params import coupling_parameters, total_parameters
from cqk_megatron.model.specs import coupling_spec, layer_spec_from_config
from cqk_megatron.parallel.process_groups import init_single_process
from cqk_megatron.perf.flops import flops_breakdown, flops_per_token
from cqk_megatron.perf.memory import activation_estimate
from cqk_megatron.variants import (
    CouplingCost,
    CouplingVariant,
    UnknownVariantError,
    build_coupling,
    registered,
    unknown_message,
)
from cqk_megatron.variants.plain_math import PositiveStep, QKCoupling

VOCAB, SEQ, BATCH, LAYERS, HEADS, KV_HEADS, HIDDEN = 100, 16, 2, 2, 8, 4, 64
TINY = [
    f"model.vocab_size={VOCAB}",
    f"model.num_layers={LAYERS}",
    f"model.hidden_size={HIDDEN}",
    f"model.num_attention_heads={HEADS}",
    f"model.num_query_groups={KV_HEADS}",
    "model.seq_length=32",
    "train.precision=fp32",
]


class ScaleQ(QKCoupling):
    """``q <- q * (1 + dt)``, ``k`` unchanged."""

    def __init__(self, head_dim: int, dt_init: float = 0.1) -> None:
        super().__init__()
        self.dt = PositiveStep(dt_init)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q * (1 + self.dt()), k


def scale_q_flops(heads, options) -> CouplingCost:
    return CouplingCost(matmul=0.0, elementwise=2.0 * heads.q_heads * heads.head_dim)


TOY = CouplingVariant("scale_q", ScaleQ, {"dt_init": "dt_init"}, flops=scale_q_flops)


@pytest.fixture(scope="module", autouse=True)
def toy():
    init_single_process()
    with registered(TOY):
        yield TOY


def toy_config(*overrides: str, coupling: str = "scale_q") -> RunConfig:
    return load_config(
        None, [f"attention.coupling={coupling}", "attention.dt_init=0.5", *TINY, *overrides]
    )


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)


def test_a_coupling_registered_here_runs_through_the_stack(tmp_path):
    config = validate(toy_config())
    assert config.attention.variant == "scale_q+standard"
    # specs and the model
    spec = coupling_spec(config.attention, config.model.head_dim)
    assert (spec.module, spec.params) == (ScaleQ, {"dt_init": 0.5})
    assert layer_spec_from_config(config).submodules.self_attention.submodules.coupling == spec
    torch.manual_seed(0)
    model = build_model(config).eval()
    assert all(type(layer.self_attention.coupling) is ScaleQ for layer in model.decoder.layers)
    # it couples: the same weights without the coupling give other logits
    torch.manual_seed(0)
    standard = build_model(toy_config(coupling="none")).eval()
    standard.load_state_dict(model.state_dict(), strict=False)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    logits = megatron_logits(model, tokens)
    assert (logits - megatron_logits(standard, tokens)).abs().max() > 1e-3
    # parameters: counted on the built module, and they are the model's
    assert coupling_parameters(config) == 1  # dt
    assert (
        total_parameters(config) == count_parameters(model) == count_parameters(standard) + LAYERS
    )
    # FLOPs: its declared term; memory: refused, naming the missing term
    parts = flops_breakdown(config)
    assert parts["coupling"] == 0 and parts["elementwise_not_counted"] == LAYERS * 2 * HIDDEN
    assert flops_per_token(config) == flops_per_token(
        standard_config := toy_config(coupling="none")
    )
    assert flops_breakdown(standard_config)["elementwise_not_counted"] == 0
    with pytest.raises(NotImplementedError, match="coupling 'scale_q' declares no 'memory' term"):
        activation_estimate(config, micro_batch=1)
    # no fused form: compiled is refused by validate, eager runs the module
    with pytest.raises(ConfigError, match="coupling 'scale_q' has no fused form"):
        validate(toy_config("attention.coupling_impl=compiled"))
    # Hugging Face export: the class's source travels, logits equal Megatron's
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.self_attention.coupling.dt.raw.add_(0.3)  # away from its initial value
    state = {name: param.detach().clone() for name, param in model.named_parameters()}
    folder = export_state_dict(state, config, tmp_path / "scale-q-hf", with_tokenizer=False)
    hf_config = json.loads((folder / "config.json").read_text())
    assert hf_config["coupling"] == "scale_q"
    assert (hf_config["coupling_class"], hf_config["coupling_source"]) == (
        "ScaleQ",
        "cqk_variant.py",
    )
    assert "class ScaleQ(QKCoupling)" in (folder / "cqk_variant.py").read_text()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, dtype=torch.float32
    ).eval()
    assert type(hf.model.layers[0].self_attn.coupling).__module__ != ScaleQ.__module__
    with torch.no_grad():
        actual = hf(tokens).logits
    expected = megatron_logits(model, tokens)
    assert (expected - logits).abs().max() > 1e-4  # the moved dt changed the logits
    assert (actual - expected).abs().max().item() < 1e-4


def toy_worker(*args) -> None:
    """``_equivalence.worker`` with the toy registered in this spawned rank too."""
    with registered(TOY):
        worker(*args)


def test_registered_coupling_under_tp2_matches_single_process(tmp_path):
    variant = "scale_q+standard"
    overrides = [*TINY[:-1], "train.precision=fp64", "model.seq_length=16"]
    run_ranks(toy_worker, 2, 2, 1, [variant], overrides, str(tmp_path), variant)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        same = result[variant]
        assert same["loss"] < 1e-6 and same["grad"] < 1e-5 and same["param"] < 1e-5, same
        assert len(same["losses"]) == 3
        # the harness sees a difference: dt's gradient, not summed across the TP ranks
        unsynced = result[f"{variant}[no-tp-grad-sum]"]
        assert unsynced["grad"] > 1e-3 and "coupling.dt" in unsynced["grad_worst"], unsynced


@pytest.mark.parametrize("kind", ["coupling", "scoring"])
def test_an_unregistered_name_is_refused_everywhere_with_one_message(kind):
    config = toy_config(coupling="none")
    setattr(config.attention, kind, "bogus")
    message = unknown_message(kind, "bogus", COUPLINGS if kind == "coupling" else SCORINGS)
    assert "'bogus' is unknown" in message and "Adding a variant" in message
    with pytest.raises(ConfigError) as refused:
        validate(config)
    assert message in str(refused.value)
    for estimate in (
        lambda: layer_spec_from_config(config),
        lambda: flops_per_token(config),
        lambda: total_parameters(config),
        lambda: activation_estimate(config, micro_batch=1),
    ):
        with pytest.raises(UnknownVariantError) as refused:
            estimate()
        assert str(refused.value) == message
    with pytest.raises(ConversionError) as refused:
        check_exportable(config)
    assert str(refused.value) == message
    hf = {"model_type": "cqk", "hidden_size": 64, "num_attention_heads": 8, "vocab_size": 128}
    hf |= {"num_hidden_layers": 2, "intermediate_size": 192, kind: "bogus"}
    with pytest.raises(ConversionError) as refused:
        run_config_from_cqk(hf, "config.json")
    assert str(refused.value) == f"config.json: {message}"
    if kind == "coupling":
        with pytest.raises(UnknownVariantError) as refused:
            build_coupling("bogus", 8)
        assert str(refused.value) == message
