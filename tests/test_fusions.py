"""Megatron-Core's fusions that need neither Transformer Engine nor Apex: on by default on
GPU (``model/gpt.py``: ``fusion_options``), each equal to its unfused form.

The fused kernels are ``torch.compile``d functions (``megatron.core.jit``), so they run on
CPU too, through inductor: the model below is built on CPU with the options a GPU run
gets, and compared with the same model built with the fusions off. What a CPU cannot
check: the Transformer Engine layer spec itself (no TE here); its ``TransformerConfig``
is checked field by field for the shipped 1B run instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _tiny import tiny_config
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.transformer import mlp as megatron_mlp

import cqk_megatron.model.gpt as gpt
from cqk_megatron.config import load_config
from cqk_megatron.parallel.process_groups import init_single_process, seed_cuda_rng_tracker

TOL = {"rtol": 1e-6, "atol": 1e-6}
REPO = Path(__file__).resolve().parents[1]
FUSION_OPTIONS = gpt.fusion_options  # the rule itself (the tests below replace it)


@pytest.fixture(scope="module", autouse=True)
def single_process():
    init_single_process()


def loss_and_grads(monkeypatch, config, **fused: bool) -> tuple[torch.Tensor, dict]:
    """One forward and backward of the tiny model, built with the CPU's fusion options and
    the ``fused`` ones turned on, from the same seed and batch."""
    options = {**FUSION_OPTIONS(config, "cpu"), **fused}
    monkeypatch.setattr(gpt, "fusion_options", lambda _config, _device_type: options)
    torch.manual_seed(0)
    seed_cuda_rng_tracker(0)
    model = gpt.build_model(config)
    assert all(getattr(model.config, name) for name in fused)
    generator = torch.Generator().manual_seed(1)
    shape = (2, config.model.seq_length + 1)
    sample = torch.randint(0, config.model.vocab_size, shape, generator=generator)
    tokens, labels = sample[:, :-1], sample[:, 1:]
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    loss = model(tokens, positions, None, labels=labels).float().mean()
    loss.backward()
    grads = {name: p.grad.float() for name, p in model.named_parameters()}
    return loss.detach(), grads


def calls_of(monkeypatch, module, name: str) -> list:
    """Count the calls of ``module.name`` (so that a test sees the fused path ran)."""
    calls, original = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def assert_same(fused: tuple, unfused: tuple, tol: dict) -> None:
    torch.testing.assert_close(fused[0], unfused[0], **tol)
    assert fused[1].keys() == unfused[1].keys()
    for name, grad in fused[1].items():
        torch.testing.assert_close(grad, unfused[1][name], **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_gpu_options_turn_on_the_fusions_without_te_or_apex():
    bf16 = tiny_config("standard", precision="bf16")
    fp32 = tiny_config("standard", precision="fp32")
    gelu = tiny_config("standard", "model.swiglu=false", precision="bf16")
    assert gpt.fusion_options(bf16, "cuda")["bias_activation_fusion"]
    assert gpt.fusion_options(bf16, "cuda")["cross_entropy_loss_fusion"]
    assert gpt.fusion_options(bf16, "cuda")["cross_entropy_fusion_impl"] == "native"
    # the native loss's backward rounds the logits' gradient to bf16: not in fp32 runs
    assert not gpt.fusion_options(fp32, "cuda")["cross_entropy_loss_fusion"]
    # Megatron's fused gelu is the tanh approximation, another function
    assert not gpt.fusion_options(gelu, "cuda")["bias_activation_fusion"]
    for config in (bf16, fp32):
        cpu = gpt.fusion_options(config, "cpu")
        assert not cpu["bias_activation_fusion"] and not cpu["cross_entropy_loss_fusion"]


def test_fused_swiglu_equals_unfused_fp32(monkeypatch):
    config = tiny_config("coupled", precision="fp32")
    unfused = loss_and_grads(monkeypatch, config)
    calls = calls_of(monkeypatch, megatron_mlp, "bias_swiglu_impl")
    fused = loss_and_grads(monkeypatch, config, bias_activation_fusion=True)
    assert len(calls) == config.model.num_layers  # the fused SwiGLU ran in every layer
    assert_same(fused, unfused, TOL)


def test_fused_swiglu_with_bias_equals_unfused_fp32(monkeypatch):
    config = tiny_config("standard", "model.add_bias_linear=true", precision="fp32")
    unfused = loss_and_grads(monkeypatch, config)
    fused = loss_and_grads(monkeypatch, config, bias_activation_fusion=True)
    assert_same(fused, unfused, TOL)


def test_fused_cross_entropy_equals_unfused_fp32():
    """The loss in fp32. (Its gradient the fused form rounds to bf16 whatever the logits'
    dtype: the bf16 model below compares it.)"""
    group = torch.distributed.group.WORLD
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(12, 2, 128, generator=generator)
    target = torch.randint(0, 128, (12, 2), generator=generator)
    fused = fused_vocab_parallel_cross_entropy(logits.clone(), target, group)
    unfused = vocab_parallel_cross_entropy(logits.clone(), target)
    torch.testing.assert_close(fused, unfused, **TOL)


def test_fused_cross_entropy_model_equals_unfused_bf16(monkeypatch):
    """The whole bf16 model with the fused loss: the loss (fp32 from bf16 logits) within
    1e-6, and every gradient the same bf16 numbers. (Not with the fused SwiGLU as well:
    compiled, it rounds ``silu(a) * b`` to bf16 once where the eager form rounds twice.)"""
    config = tiny_config("coupled", precision="bf16")
    unfused = loss_and_grads(monkeypatch, config)
    calls = calls_of(monkeypatch, gpt_language_module(), "fused_vocab_parallel_cross_entropy")
    fused = loss_and_grads(monkeypatch, config, cross_entropy_loss_fusion=True)
    assert calls, "the fused cross-entropy did not run"
    assert_same(fused, unfused, {"rtol": 0.0, "atol": 1e-6})


def gpt_language_module():
    from megatron.core.models.common.language_module import language_module

    return language_module


# The fields of Megatron's TransformerConfig that decide a GPU run's speed and numerics.
TE_RUN_FIELDS = {
    "tensor_model_parallel_size": 2,
    "sequence_parallel": True,
    "pipeline_model_parallel_size": 1,
    "bf16": True,
    "fp16": False,
    "params_dtype": torch.bfloat16,
    "pipeline_dtype": torch.bfloat16,
    "num_layers": 16,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_query_groups": 16,
    "kv_channels": 128,
    "ffn_hidden_size": 5632,
    "gated_linear_unit": True,
    "activation_func": torch.nn.functional.silu,
    "add_bias_linear": False,
    "normalization": "RMSNorm",
    "use_cpu_initialization": False,
    "perform_initialization": True,
    "bias_activation_fusion": True,
    "cross_entropy_loss_fusion": True,
    "cross_entropy_fusion_impl": "native",
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "use_te_activation_func": False,
    "batch_p2p_comm": True,
    "overlap_p2p_comm": False,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}


@pytest.fixture(scope="module")
def te_run_config():
    """The shipped 1B run's model (bf16) at TP=2 + SP, as the ladder's larger sizes run,
    with the Transformer Engine spec and the Megatron engine (which TE with SP needs):
    Megatron's config as a GPU rank builds it."""
    config = load_config(
        REPO / "configs/runs/1b_4x8.yaml",
        [
            "transformer_impl=transformer_engine",
            "train.engine=megatron",
            "parallel.tensor_parallel=2",
            "parallel.sequence_parallel=true",
        ],
    )
    return gpt.transformer_config(config, device_type="cuda")


@pytest.mark.parametrize(("field", "expected"), TE_RUN_FIELDS.items(), ids=TE_RUN_FIELDS)
def test_transformer_engine_run_config(te_run_config, field, expected):
    assert getattr(te_run_config, field) == expected
