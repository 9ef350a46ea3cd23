"""FLOPs per token of every attention variant, and model FLOPs utilisation (MFU).

A pure function of the ``RunConfig``. Conventions (those of PaLM, Chowdhery et al. 2022,
appendix B, and Megatron-LM, Narayanan et al. 2021), stated once:

- Only matrix multiplications count, 2 FLOPs per multiply-add (what
  ``torch.utils.flop_counter.FlopCounterMode`` counts: mm, addmm, bmm and the fused
  attention kernels). Norms, SiLU, RoPE, softmax, residual adds and the integrators'
  vector updates are left out of the totals; the coupling's vector work is reported
  beside them as ``elementwise_not_counted`` so its size is visible.
- Attention scores and context are counted over the full ``s x s`` square, causal or not
  (no halving for the mask): PaLM's ``12 L H Q T`` and Megatron's ``s / 6h`` term, and
  what FlopCounterMode's SDPA formula does.
- Backward = 2 x forward for every matmul (gradients of input and of weight), so a
  training step is 3 x forward: model FLOPs, the numerator of MFU. A flash attention
  backward also recomputes the score matrix; ``flash_recompute=True`` adds that matmul
  (hardware FLOPs, as FlopCounterMode reports for the GPU flash/cuDNN kernels).
- Grouped-query attention: the kernels read a shared key/value head for every query
  head, so scores and context are counted over query heads (as the SDPA formula does).
"""

from __future__ import annotations

from cqk_megatron.config import RunConfig
from cqk_megatron.variants import CouplingCost, Heads, coupling, scoring

# Dense bf16 tensor-core peaks per GPU (no 2:4 sparsity), from the vendor data sheets.
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12,  # same GH100 compute as H100 SXM (torch names it "NVIDIA H200")
    "H200 NVL": 835e12,  # the PCIe card, at the H100 NVL's clocks
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "A100": 312e12,
    "L40S": 362e12,
}


def coupling_cost(config: RunConfig) -> CouplingCost:
    """One layer's coupling per token, as the registered coupling declares it (the form that
    runs: see ``cqk_megatron/variants/builtin.py``); refused, naming the missing term, for
    a coupling registered without one."""
    a, m = config.attention, config.model
    variant = coupling(a.coupling)
    return variant.cost(Heads.of(m), variant.constructor_options(a, m.head_dim))


def coupling_flops(config: RunConfig) -> float:
    """Forward matmul FLOPs of one layer's coupling, per token."""
    return coupling_cost(config).matmul


def coupling_vector_flops(config: RunConfig) -> float:
    """The coupling's elementwise work per token and layer (not in the totals)."""
    return float(coupling_cost(config).elementwise)


def attention_flops(config: RunConfig, seq_length: int) -> tuple[float, float]:
    """(scores, context) forward FLOPs per token and layer over the full ``s x s`` square.

    Each of the scoring's attention calls (``AttentionCalls``) scores every one of its
    query heads against ``s`` keys of width ``head_dim`` and applies the map to values of
    its ``value_width``. Standard: one call over the ``H`` heads, width ``d``.
    Differential: two maps per differential head (``H/2`` of them), values ``2d`` wide.
    """
    m = config.model
    calls = scoring(config.attention.scoring).attention_calls(Heads.of(m))
    per_head = 2.0 * calls.calls * calls.q_heads * seq_length
    return per_head * m.head_dim, per_head * calls.value_width


def flops_breakdown(config: RunConfig, seq_length: int | None = None) -> dict[str, float]:
    """Forward FLOPs per token by part (whole model, every layer summed).

    Keys: ``qkv``, ``attention_proj``, ``mlp``, ``attention_scores``,
    ``attention_context``, ``coupling``, ``logits``, ``total`` (their sum), and
    ``elementwise_not_counted`` (the coupling's vector ops, outside ``total``).
    """
    m = config.model
    s = seq_length or m.seq_length
    h, d, hq, hkv, f, layers = (
        m.hidden_size,
        m.head_dim,
        m.num_attention_heads,
        m.kv_heads,
        m.ffn_size,
        m.num_layers,
    )
    scores, context = attention_flops(config, s)
    parts = {
        "qkv": layers * 2.0 * h * (hq + 2 * hkv) * d,
        "attention_proj": layers * 2.0 * hq * d * h,
        # SwiGLU: gate and up (h -> 2f, one fused matrix) then down (f -> h)
        "mlp": layers * (6.0 if m.swiglu else 4.0) * h * f,
        "attention_scores": layers * scores,
        "attention_context": layers * context,
        "coupling": layers * coupling_flops(config),
        "logits": 2.0 * h * m.padded_vocab_size,
    }
    parts["total"] = sum(parts.values())
    parts["elementwise_not_counted"] = layers * coupling_vector_flops(config)
    return parts


def flops_per_token(
    config: RunConfig,
    training: bool = True,
    seq_length: int | None = None,
    flash_recompute: bool = False,
) -> float:
    """Model FLOPs per token: forward, or forward + backward (3 x forward) if training.

    ``flash_recompute`` adds the score matmul that a flash/cuDNN backward recomputes
    (hardware FLOPs; MFU uses model FLOPs, the default).
    """
    parts = flops_breakdown(config, seq_length)
    if not training:
        return parts["total"]
    total = 3.0 * parts["total"]
    if flash_recompute:
        total += parts["attention_scores"]
    return total


def peak_flops(device_name: str | None = None, dtype: str = "bf16") -> float | None:
    """Dense peak FLOP/s of a GPU by name (default: the current CUDA device); None on CPU,
    for an unknown GPU, or for a dtype other than bf16 (the only one tabled)."""
    if device_name is None:
        import torch

        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    if dtype != "bf16":
        return None
    name = device_name.upper()
    if "H200" in name:  # H200 SXM, GH200 (its Hopper part), H200 NVL
        return PEAK_BF16_FLOPS["H200 NVL" if "NVL" in name else "H200"]
    if "H100" in name:
        if "PCIE" in name:
            return PEAK_BF16_FLOPS["H100 PCIe"]
        if "NVL" in name:
            return PEAK_BF16_FLOPS["H100 NVL"]
        return PEAK_BF16_FLOPS["H100 SXM"]
    if "A100" in name:
        return PEAK_BF16_FLOPS["A100"]
    if "L40S" in name:
        return PEAK_BF16_FLOPS["L40S"]
    return None


def mfu(
    tokens_per_s: float,
    config: RunConfig,
    peak: float | None,
    num_gpus: int = 1,
    seq_length: int | None = None,
) -> float | None:
    """Model FLOPs utilisation: training FLOPs per second over ``num_gpus`` x ``peak``.

    ``tokens_per_s`` is the throughput of all ``num_gpus`` together; None if ``peak``
    is None (CPU, unknown GPU).
    """
    if peak is None or peak <= 0:
        return None
    achieved = tokens_per_s * flops_per_token(config, training=True, seq_length=seq_length)
    return achieved / (num_gpus * peak)
