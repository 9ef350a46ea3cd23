"""The Megatron model's coupled attention against an independent plain-PyTorch model.

``cqk_megatron/eval/plain_model.py`` writes the transformer and every coupling out from
their formulas, importing nothing from this package (not ``plain_math.py``, not Megatron).
Here a Megatron ``GPTModel`` and a ``PlainLM`` hold identical weights (copied by name)
and see identical tokens, in fp64: logits and the gradient of every parameter must agree
to 1e-9, for every coupling, before and after RoPE, with and without grouped-query
attention, in both model families. Weights are perturbed away from their initialisation
so that every parameter (the invertible coupling's zero output layers, the biases)
changes the output. A control moves the plain model's coupling to the other side of RoPE
and must see a difference.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from _tiny import tiny_config

from cqk_megatron.config import validate
from cqk_megatron.eval.mqar_models import (
    build_megatron,
    plain_config_for,
    plain_copy_of,
    plain_state_from_megatron,
)
from cqk_megatron.eval.plain_model import COUPLINGS, PlainLM
from cqk_megatron.variants import COUPLINGS as REGISTERED_COUPLINGS

TOLERANCE = 1e-9
VOCAB, SEQ, BATCH = 64, 12, 3


def make_config(coupling: str, position: str, family: str, kv_heads: int, steps: int = 1):
    return validate(
        tiny_config(
            f"{coupling}+standard",
            f"attention.position={position}",
            f"attention.steps={steps}",
            f"model.family={family}",
            "model.make_vocab_size_divisible_by=8",
            vocab=VOCAB,
            hidden=32,
            heads=4,
            kv_heads=kv_heads,
            seq=SEQ,
            precision="fp64",
        )
    )


def perturbed_megatron(config, seed: int = 0):
    torch.manual_seed(seed)
    model = build_megatron(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # sharp attention (large q/k weights) so that positions and coupling matter
            big = param.dim() < 2 or ".coupling." in name or "linear_qkv" in name
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            param.add_(noise * (0.3 if big else 0.05))
    return model


def forward_and_grads(model, tokens):
    if isinstance(model, PlainLM):
        logits = model(tokens)
    else:
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = model(tokens, positions, None)
    weights = torch.linspace(-1, 1, logits.numel(), dtype=logits.dtype).view_as(logits)
    (logits * weights).sum().backward()  # a loss whose gradient reaches every logit
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def compare(config, plain=None):
    megatron = perturbed_megatron(config)
    plain = plain or plain_copy_of(megatron, config, attention_kernel="explicit")
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    expected, megatron_grads = forward_and_grads(megatron, tokens)
    actual, plain_grads = forward_and_grads(plain, tokens)
    logit_error = ((actual - expected).abs().max() / expected.abs().max()).item()
    mapped = plain_state_from_megatron(megatron_grads, config)
    assert set(mapped) == set(plain_grads), "every parameter has its counterpart"
    # relative to the largest gradient of the model: some are zero in exact arithmetic
    # (a key bias under standard attention) and carry only rounding noise
    scale = max(g.abs().max().item() for g in mapped.values())
    grad_errors = {
        name: ((plain_grads[name] - grad).abs().max() / scale).item()
        for name, grad in mapped.items()
    }
    return logit_error, grad_errors, expected


CASES = [
    (coupling, position, "llama", kv)
    for coupling, position, kv in itertools.product(COUPLINGS, ("pre_rope", "post_rope"), (4, 2))
    if not (coupling == "none" and position == "post_rope")
] + [(coupling, "pre_rope", "gpt2", kv) for coupling in COUPLINGS for kv in (4, 2)]


def test_the_plain_model_writes_out_every_registered_coupling():
    """The independent model (its own list, by design) covers the registry's couplings,
    so each is checked against it below."""
    assert set(COUPLINGS) == set(REGISTERED_COUPLINGS)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-kv{c[3]}")
def test_megatron_coupled_attention_equals_plain_pytorch(case):
    coupling, position, family, kv_heads = case
    config = make_config(coupling, position, family, kv_heads)
    logit_error, grad_errors, expected = compare(config)
    assert expected.std() > 0.1  # not two near-constant outputs
    assert logit_error < TOLERANCE
    worst = max(grad_errors, key=grad_errors.get)
    assert grad_errors[worst] < TOLERANCE, (worst, grad_errors[worst])
    coupling_grads = [n for n in grad_errors if ".coupling." in n]
    assert (coupling == "none") == (not coupling_grads), "the coupling's gradients are compared"


@pytest.mark.parametrize("coupling", ["hamiltonian", "euler"])
def test_several_steps_equal_plain_pytorch(coupling):
    config = make_config(coupling, "pre_rope", "llama", 2, steps=3)
    logit_error, grad_errors, _ = compare(config)
    assert logit_error < TOLERANCE and max(grad_errors.values()) < TOLERANCE


@pytest.mark.parametrize("position", ["pre_rope", "post_rope"])
def test_control_the_comparison_sees_the_coupling_position(position):
    """The plain model with its coupling on the other side of RoPE must disagree."""
    config = make_config("hamiltonian", position, "llama", 2)
    megatron = perturbed_megatron(config)
    other = "post_rope" if position == "pre_rope" else "pre_rope"
    plain = dataclasses.replace(
        plain_config_for(config), coupling_position=other, attention_kernel="explicit"
    )
    swapped = PlainLM(plain)
    swapped.to(torch.float64)
    swapped.load_state_dict(plain_state_from_megatron(dict(megatron.state_dict()), config))
    logit_error, grad_errors, _ = compare(config, plain=swapped)
    assert logit_error > 1e-3 and max(grad_errors.values()) > 1e-3


@pytest.mark.parametrize("position", ["pre_rope", "post_rope"])
def test_training_steps_equal_plain_pytorch(position):
    """Twenty AdamW steps on MQAR batches from identical weights: the same losses and the
    same weights afterwards (nothing lost between the gradient and the update: hooks,
    parameter lists, dtypes)."""
    from cqk_megatron.eval.mqar_data import IGNORE_INDEX, MQARSetting, generate
    from cqk_megatron.eval.mqar_models import query_logits

    config = make_config("hamiltonian", position, "llama", 2)
    megatron = perturbed_megatron(config)
    plain = plain_copy_of(megatron, config, attention_kernel="explicit")
    setting = MQARSetting(SEQ, 2)
    losses = {}
    for name, model in (("megatron", megatron), ("plain", plain)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        rng = torch.Generator().manual_seed(0)
        losses[name] = []
        for _ in range(20):
            tokens, labels = generate(
                8, setting, VOCAB, seed=int(torch.randint(0, 99, (1,), generator=rng))
            )
            mask = labels != IGNORE_INDEX
            loss = torch.nn.functional.cross_entropy(
                query_logits(model, tokens, mask), labels[mask]
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
    assert losses["megatron"][-1] < losses["megatron"][0] - 0.1  # it trained
    assert max(abs(a - b) for a, b in zip(losses["megatron"], losses["plain"], strict=True)) < 1e-8
    final = plain_state_from_megatron(dict(megatron.state_dict()), config)
    for name, param in plain.state_dict().items():
        assert (param - final[name]).abs().max() < 1e-8, name
