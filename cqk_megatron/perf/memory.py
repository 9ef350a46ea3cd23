"""Memory of one GPU under a TP x PP x DP layout: parameters, gradients, optimizer
states and activations, as pure functions of the ``RunConfig``.

Parameters per rank are the one count's (``cqk_megatron.model.params.stage_parameters``).

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"), whose ``s b h (34 + 5 a s / h)`` bytes per layer counts the
tensors that autograd keeps for the backward. We count the same thing for this model,
tensor by tensor (``activation_terms``), because its layer differs: RMSNorm keeps its
input, normalised input and 1/rms; SwiGLU keeps the gate/up output, SiLU(gate), the
``up`` operand and the product; there is no dropout (no masks); and SDPA's fused kernels
(flash/cuDNN/memory-efficient on GPU, the flash kernel on CPU) keep q, k, v, the output
and the log-sum-exp, never the ``s x s`` score matrix. PyTorch's math path (used when
no fused kernel applies: e.g. differential attention on CPU, whose values are twice as
wide as its queries) keeps the softmax probabilities: ``sdpa_kernel="math"``. The
coupling keeps its MLP's input, hidden pre-activation and activation for every
evaluation of ``f`` plus the operands of its ``q + dt k`` products; differential attention
keeps two attention outputs and its RMSNorm's tensors. A kept view keeps its whole
storage alive: when SDPA keeps ``v``, a view of the fused QKV projection output, all of
that output stays. Tensors over the hidden size are split by TP only with sequence
parallelism; tensors over heads or the FFN width always are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cqk_megatron.config import RECOMPUTE, RECOMPUTE_METHODS, RunConfig
from cqk_megatron.model.params import (
    coupling_parameters,
    embedding_parameters,
    norm_parameters,
    scoring_parameters,
)
from cqk_megatron.training.engines import SHARDINGS
from cqk_megatron.variants import ActivationTerm, Heads, coupling, scoring

BYTES = {"fp32": 4, "bf16": 2, "fp64": 8}
# train.recompute's choices, from config/schema.py; ActivationTerm, from the variant registry
__all__ = ["RECOMPUTE", "RECOMPUTE_METHODS", "ActivationTerm"]
SDPA_KERNELS = ("fused", "math")


# ---------------------------------------------------------------------------------------
# model states: parameters, gradients, optimizer
# ---------------------------------------------------------------------------------------


def model_state_bytes(
    parameters: int, precision: str, sharding: str, dp: int, offload_optimizer: bool = False
) -> dict[str, float]:
    """Bytes of parameters, gradients and Adam states for ``parameters`` on one rank.

    Mixed precision (bf16): bf16 parameters (2 B), fp32 gradients (4 B, Megatron's
    ``main_grad`` / DeepSpeed's fp32 accumulation), fp32 master copy (4 B) and two fp32
    Adam moments (8 B): 18 B per parameter unsharded. fp32 training has no master copy.
    Sharding over the ``dp`` data-parallel ranks: ZeRO-1 and Megatron's distributed
    optimizer shard master + moments; ZeRO-2 also gradients; ZeRO-3 also parameters.
    ``offload_optimizer`` (DeepSpeed): master and moments live in CPU memory.
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r} is unknown; choose one of {list(SHARDINGS)}")
    param_bytes = BYTES[precision]
    grad_bytes = max(4, param_bytes)
    master_bytes = 4 if param_bytes < 4 else 0
    moment_bytes = 2 * max(4, param_bytes)
    split = SHARDINGS[sharding]
    return {
        "parameters": parameters * param_bytes / (dp if split.parameters else 1),
        "gradients": parameters * grad_bytes / (dp if split.gradients else 1),
        "optimizer": 0.0
        if offload_optimizer
        else parameters * (master_bytes + moment_bytes) / (dp if split.optimizer else 1),
    }


# DeepSpeed BF16_Optimizer's ZeRO-1 reduction flattens its fp32 gradients in buckets of this
# many elements (``buffered_allreduce_fallback``), whatever the config says.
DEEPSPEED_FALLBACK_BUCKET = 500_000_000


def engine_buffer_bytes(
    parameters: int,
    precision: str,
    sharding: str,
    bucket_elements: int,
    overlap: bool,
    largest_parameter: int = 0,
    persistent_parameters: int = 0,
) -> dict[str, float]:
    """The buffers an engine allocates beyond parameters, gradients and optimizer states,
    for ``parameters`` on one rank and a gradient bucket of ``bucket_elements``.

    ``reduce_buckets`` live through the backward: DeepSpeed ZeRO-2 copies each gradient
    into a bucket in the parameters' dtype, two of them with ``overlap_comm`` (one filling
    while the other is reduced: ``setup_buckets`` in ``stage_1_and_2.py``). The
    ``reduction_copy`` is transient: the fp32 copy of a bf16 bucket that ZeRO-2 all-reduces
    (``gradient_reduction_w_predivide``: ``tensor.to(communication_data_type)``), of the
    bucket, or of ``largest_parameter`` where one parameter is larger (it is reduced on its
    own), or of the whole gradient where that is smaller; bf16 ZeRO-1 (BF16_Optimizer)
    flattens its fp32 gradients into one buffer of up to ``DEEPSPEED_FALLBACK_BUCKET``
    elements to all-reduce. Megatron's distributed optimizer allocates nothing more: its
    fp32 gradient buffer (the ``gradients``) is reduce-scattered in place, and the bf16
    parameters are views of its parameter buffer. ZeRO-3: ``zero3_buffer_bytes``.
    """
    low = BYTES[precision]
    if sharding == "zero3":
        return zero3_buffer_bytes(
            parameters, precision, bucket_elements, largest_parameter, persistent_parameters
        )
    if sharding == "zero2":
        buckets = (2 if overlap else 1) * bucket_elements * low
        copy = min(max(bucket_elements, largest_parameter), parameters) * 4 if low < 4 else 0
        return {"reduce_buckets": float(buckets), "reduction_copy": float(copy)}
    if sharding == "zero1" and low < 4:
        return {
            "reduce_buckets": 0.0,
            "reduction_copy": min(DEEPSPEED_FALLBACK_BUCKET, parameters) * 4.0,
        }
    return {"reduce_buckets": 0.0, "reduction_copy": 0.0}


# DeepSpeed's ``stage3_param_persistence_threshold`` (default, which the engine keeps):
# parameters of at most this many elements stay whole on every rank.
ZERO3_PERSISTENCE_THRESHOLD = 100_000


def zero3_persistent_parameters(
    config: RunConfig, tp: int = 1, pp: int = 1, first: bool = True, last: bool = True
) -> int:
    """Elements on one rank of a pipeline stage that ZeRO-3 keeps whole: each tensor of at
    most ``ZERO3_PERSISTENCE_THRESHOLD`` elements (the tensors as ``model.params`` lists them). A
    coupling's or scoring's tensors count when their layer's total is under it (they
    are not listed one by one; above it, they are left out)."""
    m = config.model
    h, d, hq, hkv, f = m.hidden_size, m.head_dim, m.num_attention_heads, m.kv_heads, m.ffn_size
    fc1_rows = f * (2 if m.swiglu else 1)
    per_layer = [h * (hq + 2 * hkv) * d // tp, hq * d * h // tp, h * fc1_rows // tp, f * h // tp]
    per_layer += [norm_parameters(config)] * 2
    if m.add_bias_linear:
        per_layer += [(hq + 2 * hkv) * d // tp, fc1_rows // tp, h, h]
    per_layer += [coupling_parameters(config) + scoring_parameters(config)]
    tensors = per_layer * (m.num_layers // pp)
    if first:
        tensors.append(embedding_parameters(config, tp))
        if m.position_embedding_type == "learned_absolute":
            tensors.append(m.seq_length * h)
    if last:
        tensors.append(norm_parameters(config))
        if not (m.tie_embeddings and first):
            tensors.append(embedding_parameters(config, tp))
    return sum(n for n in tensors if n <= ZERO3_PERSISTENCE_THRESHOLD)


ZERO3_REUSE_DISTANCE = 1_000_000_000  # DeepSpeed 0.19.8's stage3_max_reuse_distance default


def zero3_buffer_bytes(
    parameters: int,
    precision: str,
    bucket_elements: int,
    largest_parameter: int,
    persistent_parameters: int,
) -> dict[str, float]:
    """DeepSpeed 0.19.8 ZeRO-3's buffers beyond its partitions (``model_state_bytes``),
    as ``training/engines/deepspeed.py`` configures it, for ``parameters`` on one rank.

    - ``reduce_buckets``: one bucket in the communication dtype (fp32: ``bf16_settings``),
      into which each gradient is copied as autograd produces it (``contiguous_gradients``;
      ``stage3.py``, ``__add_grad_to_ipg_bucket``).
    - ``reduction_copy``: ``reduce_scatter_coalesced`` concatenates a bucket's gradients
      into one fp32 buffer; a parameter larger than the bucket is reduced alone, its bf16
      gradient copied to fp32 (``__avg_scatter_grads``).
    - ``gathered_parameters``: the whole bf16 copies that the parameter coordinator holds
      while the model computes. With DeepSpeed's defaults (``stage3_max_reuse_distance``
      and ``stage3_max_live_parameters`` 1e9 elements), which the engine keeps, a parameter
      stays gathered from its forward to its backward whenever less than 1e9 elements of
      the trace lie between them: every partitioned parameter of a rank holding fewer.
    - ``persistent_parameters``: the whole copies of the parameters under
      ``ZERO3_PERSISTENCE_THRESHOLD``, never released (their partitions are in the
      ``parameters``).
    """
    low = BYTES[precision]
    comm = max(4, low)
    partitioned = parameters - persistent_parameters
    return {
        "reduce_buckets": float(bucket_elements * comm),
        "reduction_copy": float(min(max(bucket_elements, largest_parameter), parameters) * comm),
        "gathered_parameters": float(min(ZERO3_REUSE_DISTANCE, partitioned) * low),
        "persistent_parameters": float(persistent_parameters * low),
    }


# ---------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------


def _coupling_terms(config: RunConfig) -> tuple[dict[str, ActivationTerm], bool]:
    """What the coupling keeps, as it runs (``attention/fast_coupling.py``, eager or
    compiled), as its registration declares it; and whether it keeps a view of the QKV
    output (its pre-RoPE q or k)."""
    a, m = config.attention, config.model
    variant = coupling(a.coupling)
    kept = variant.kept(Heads.of(m), variant.constructor_options(a, m.head_dim))
    terms = {"coupling": ActivationTerm(kept.elements, group="coupling")} if kept.elements else {}
    return terms, kept.keeps_qkv_view


def activation_terms(
    config: RunConfig, seq_length: int | None = None, sdpa_kernel: str = "fused"
) -> dict[str, ActivationTerm]:
    """What one transformer layer keeps for the backward, per token, by tensor."""
    if sdpa_kernel not in SDPA_KERNELS:
        raise ValueError(f"sdpa_kernel={sdpa_kernel!r}; choose one of {list(SDPA_KERNELS)}")
    m, a = config.model, config.attention
    h, d, hq, f = m.hidden_size, m.head_dim, m.num_attention_heads, m.ffn_size
    s = seq_length or m.seq_length
    heads, rule = Heads.of(m), scoring(a.scoring)
    coupling_terms, coupling_keeps_view = _coupling_terms(config)
    stats = 1 if m.normalization == "RMSNorm" else 2  # 1/rms (and the mean for LayerNorm)
    terms = {
        # two norms (input and normalised input), their outputs as the linears' inputs
        "norms": ActivationTerm(2 * 2 * h, sharded=False),
        "norm_stats": ActivationTerm(2 * stats, sharded=False, dtype="fp32"),
        "qkv_and_fc1_inputs": ActivationTerm(2 * h, sharded=False),
        "proj_input": ActivationTerm(hq * d),
        # SwiGLU: fc1 output [gate; up] (2f), SiLU(gate), up + offset, product = fc2 input
        "mlp": ActivationTerm((2 + 1 + 1 + 1) * f if m.swiglu else 2 * f),
    }
    # A kept view keeps the whole fused QKV output alive: the value that a scoring hands to
    # SDPA as it is (not a copy), or a coupling's pre-RoPE q or k.
    if rule.keeps_value_view or coupling_keeps_view:
        terms["qkv_output"] = ActivationTerm((hq + 2 * m.kv_heads) * d)
    terms["q_k_after_rope"] = ActivationTerm((hq + m.kv_heads) * d, group="core_attention")
    terms.update(rule.activation_terms(heads))  # the scoring's own (differential: its norm)
    attention_calls = rule.attention_calls(heads)
    calls, q_heads = attention_calls.calls, attention_calls.q_heads
    v_width, v_heads = attention_calls.value_width, attention_calls.kv_heads
    if sdpa_kernel == "fused":
        terms["sdpa_output"] = ActivationTerm(calls * q_heads * v_width, group="core_attention")
        terms["sdpa_logsumexp"] = ActivationTerm(
            calls * q_heads, dtype="fp32", group="core_attention"
        )
    else:  # math path: scaled q, k and v expanded to the query heads, softmax probabilities
        group = q_heads // v_heads
        expanded = (q_heads * d + q_heads * v_width) if group > 1 else 0.0
        terms["sdpa_math"] = ActivationTerm(
            calls * (q_heads * d + expanded + q_heads * s), group="core_attention"
        )
    terms.update(coupling_terms)
    return terms


@dataclass
class ActivationEstimate:
    """Bytes kept for the backward on one rank for one micro-batch, by part."""

    per_layer: dict[str, float] = field(default_factory=dict)
    layer_bytes: float = 0.0  # one layer, as stored under the recompute policy
    full_layer_bytes: float = 0.0  # one layer without recomputation (full recompute's peak)
    input_bytes: float = 0.0  # one layer's input: what a fully recomputed unit keeps
    kept_layer_bytes: float = 0.0  # one layer outside full recompute (block's other layers)
    embedding_bytes: float = 0.0  # first stage
    output_bytes: float = 0.0  # last stage: final norm, output-layer input, CE softmax
    logits_transient_bytes: float = 0.0  # last stage: logits and their gradient in flight


def activation_estimate(
    config: RunConfig,
    micro_batch: int,
    seq_length: int | None = None,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    recompute_coupling: bool = False,
    sdpa_kernel: str = "fused",
) -> ActivationEstimate:
    """Activation bytes for one micro-batch of ``micro_batch x seq_length`` tokens.

    ``recompute``: ``none``; ``selective`` (Megatron's core-attention recomputation: the
    SDPA outputs, log-sum-exp and differential norm are recomputed; its inputs are kept; a
    post-RoPE coupling runs inside the core attention's pre-hook, so it is recomputed too);
    ``full`` (each layer keeps only its input, and one layer is rebuilt at a time; see
    ``stage_activation_bytes`` for ``train.recompute_method`` and ``_num_layers``).
    ``recompute_coupling`` drops the coupling's intermediates (its inputs are kept anyway).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}; choose one of {list(RECOMPUTE)}")
    m = config.model
    s = seq_length or m.seq_length
    tokens = micro_batch * s
    act = BYTES[config.train.precision]
    split_hidden = tp if sequence_parallel else 1

    def term_bytes(term: ActivationTerm) -> float:
        size = act if term.dtype == "act" else max(4, act)
        return term.elements * tokens * size / (tp if term.sharded else split_hidden)

    terms = activation_terms(config, s, sdpa_kernel)
    per_layer = {name: term_bytes(term) for name, term in terms.items()}
    if m.position_embedding_type == "rope":  # cos and sin, for q and k, per position
        per_layer["rope_tables"] = 4 * s * m.head_dim * act
    full_layer = sum(per_layer.values())
    dropped = set()
    if recompute == "selective":
        dropped |= {n for n, t in terms.items() if t.group == "core_attention"}
        dropped -= {"q_k_after_rope", "value_pairs"}  # the checkpoint keeps its inputs
        if config.attention.position == "post_rope":
            dropped |= {n for n, t in terms.items() if t.group == "coupling"}
    if recompute_coupling:
        dropped |= {n for n, t in terms.items() if t.group == "coupling"}
    layer_input = tokens * m.hidden_size * act / split_hidden
    kept = sum(v for n, v in per_layer.items() if n not in dropped)
    layer = layer_input if recompute == "full" else kept
    h, vocab = m.hidden_size, m.padded_vocab_size // tp
    stats = 1 if m.normalization == "RMSNorm" else 2
    output = (
        tokens
        * (
            (3 * h * act) / split_hidden  # final norm input and normalised, output-layer input
            + stats * 4 / split_hidden
            + vocab * 4  # the cross entropy keeps exp(logits - max) in fp32
            + 1  # target mask (bool)
        )
        + micro_batch * s * 8
    )  # masked targets (int64)
    return ActivationEstimate(
        per_layer=per_layer,
        layer_bytes=layer,
        full_layer_bytes=full_layer,
        input_bytes=layer_input,
        kept_layer_bytes=kept,
        embedding_bytes=tokens * 8,  # token ids (int64) for the embedding backward
        output_bytes=output,
        # bf16 logits, their fp32 copy and the gradient cast back, beside the kept softmax
        logits_transient_bytes=tokens * vocab * (act + 4),
    )


def stage_activation_bytes(
    estimate: ActivationEstimate,
    layers: int,
    chunks: int,
    recompute: str,
    method: str = "uniform",
    num_layers: int | None = None,
) -> tuple[float, float]:
    """(bytes kept for one micro-batch by a pipeline rank's ``layers`` transformer layers in
    ``chunks`` model chunks, the transient peak of rebuilding them in the backward).

    Megatron-Core's full recompute, per chunk of ``layers / chunks`` layers: ``uniform``
    checkpoints units of ``num_layers`` layers (default 1), each keeping its input, and
    rebuilds one unit at a time (its layers' whole activations at once); ``block``
    checkpoints the first ``num_layers`` layers (default all), one at a time, and the
    others keep what they keep without recompute. ``none``/``selective``: no rebuild peak
    beyond one core attention's, left out (it is far below a layer's).
    """
    if recompute != "full":
        return layers * estimate.layer_bytes, 0.0
    if method not in RECOMPUTE_METHODS:
        raise ValueError(f"recompute_method={method!r}; choose one of {list(RECOMPUTE_METHODS)}")
    per_chunk = layers // chunks
    if method == "uniform":
        unit = num_layers or 1
        if per_chunk % unit:
            raise ValueError(f"recompute_num_layers={unit} does not divide {per_chunk} layers")
        return chunks * (per_chunk // unit) * estimate.input_bytes, unit * estimate.full_layer_bytes
    recomputed = per_chunk if num_layers is None else min(num_layers, per_chunk)
    kept = recomputed * estimate.input_bytes + (per_chunk - recomputed) * estimate.kept_layer_bytes
    return chunks * kept, estimate.full_layer_bytes if recomputed else 0.0


def microbatches_in_flight(
    pp: int, stage: int, num_microbatches: int | None, vp: int | None = None
) -> float:
    """Layers' worth of activations a pipeline rank holds at its peak, in units of
    ``num_layers / pp`` (its own layers for one micro-batch).

    1F1B: stage ``i`` holds ``min(pp - i, M)`` micro-batches. Interleaved (``vp`` chunks
    per rank): the first rank runs ``2 (pp - 1) + (vp - 1) pp`` warm-up chunk forwards
    before its first backward, i.e. ``pp + (pp - 1) / vp`` stages' worth (Korthikanti
    et al.: ``1 + (p - 1) / (p m)`` times the non-interleaved ``L`` layers).
    """
    m = num_microbatches if num_microbatches is not None else math.inf
    if vp is None or vp == 1 or pp == 1:
        return float(min(pp - stage, m))
    chunks = 2 * (pp - 1 - stage) + (vp - 1) * pp + 1
    return min(chunks, m * vp) / vp
