"""The one parameter count: a model's parameters as pure functions of its ``RunConfig``.

Every caller counts here: the planner's token budgets (``planner.parameters``), the memory
estimates and ``cqk plan`` (per rank of a TP x PP layout), pre-flight's checkpoint size,
the training record's ``params_total`` / ``params_non_embedding``, analysis tables and
``cqk params`` (``perf/overhead.py``). Nothing here builds a Megatron model or starts a
process group, and the module imports no torch, so a login node or an analysis machine
counts a 7B model at once.

Dense tensors are counted as Megatron-Core's ``GPTModel`` (local spec) allocates them on
each rank; the attention variant's own terms are the registry's
(``CouplingVariant.parameters``, ``ScoringVariant.parameters``: counted on the variant's
module built on the meta device, which imports torch only then). ``tests/test_params.py``
compares the count with ``sum(p.numel())`` of a built Megatron model for every variant.
"""

from __future__ import annotations

from cqk_megatron.config import RunConfig
from cqk_megatron.variants import coupling, scoring


def norm_parameters(config: RunConfig) -> int:
    """One norm over the hidden size: RMSNorm has a weight, LayerNorm a weight and bias."""
    h = config.model.hidden_size
    return h if config.model.normalization == "RMSNorm" else 2 * h


def coupling_parameters(config: RunConfig) -> int:
    """One layer's coupling (whole on every TP rank): the registry's term."""
    a, d = config.attention, config.model.head_dim
    variant = coupling(a.coupling)
    return variant.parameters(d, variant.constructor_options(a, d))


def scoring_parameters(config: RunConfig) -> int:
    """One layer's scoring parameters (differential: lambda and its norm): the registry's."""
    variant = scoring(config.attention.scoring)
    return variant.parameters(config.model.head_dim, variant.constructor_options(config.attention))


def layer_parameters(config: RunConfig, tp: int = 1) -> int:
    """One transformer layer on one TP rank.

    With ``add_bias_linear`` the column-parallel biases (QKV, fc1) are split like their
    rows; the row-parallel ones (attention output, fc2) are whole on every rank.
    """
    m = config.model
    h, d, hq, hkv, f = m.hidden_size, m.head_dim, m.num_attention_heads, m.kv_heads, m.ffn_size
    fc1_rows = f * (2 if m.swiglu else 1)  # gate and up fused
    sharded = (
        h * (hq + 2 * hkv) * d  # linear_qkv (column parallel)
        + hq * d * h  # linear_proj (row parallel)
        + h * fc1_rows  # linear_fc1
        + f * h  # linear_fc2
    )
    if m.add_bias_linear:
        sharded += (hq + 2 * hkv) * d + fc1_rows
    if sharded % tp:
        raise ValueError(f"layer weights do not split evenly over tensor_parallel={tp}")
    replicated = 2 * norm_parameters(config) + coupling_parameters(config)
    if m.add_bias_linear:
        replicated += 2 * h
    return sharded // tp + replicated + scoring_parameters(config)


def embedding_parameters(config: RunConfig, tp: int = 1) -> int:
    """One vocabulary table (word embeddings or output layer) on one TP rank."""
    return config.model.padded_vocab_size // tp * config.model.hidden_size


def stage_parameters(
    config: RunConfig, tp: int = 1, pp: int = 1, first: bool = True, last: bool = True
) -> int:
    """Parameters on one rank of a pipeline stage holding ``num_layers / pp`` layers.

    The first stage has the word embeddings (and the learned position table, whole on
    every TP rank); the last the final norm and the output layer, whose weight is the
    embedding's when tied and both are on one stage (a tied output on a later stage keeps
    its own copy, kept equal by Megatron).
    """
    m = config.model
    if m.num_layers % pp:
        raise ValueError(f"model.num_layers={m.num_layers} does not split over pp={pp}")
    total = m.num_layers // pp * layer_parameters(config, tp)
    if first:
        total += embedding_parameters(config, tp)
        if m.position_embedding_type == "learned_absolute":
            total += m.seq_length * m.hidden_size
    if last:
        total += norm_parameters(config)
        if not (m.tie_embeddings and first):
            total += embedding_parameters(config, tp)
    return total


def total_parameters(config: RunConfig) -> int:
    """Parameters of the whole model (TP = PP = 1; a tied output layer counted once)."""
    return stage_parameters(config, 1, 1, first=True, last=True)


def vocabulary_parameters(config: RunConfig) -> int:
    """The word embeddings and, when untied, the output layer: ``padded_vocab * hidden``
    each (what "non-embedding" parameters leave out; learned positions stay in)."""
    return embedding_parameters(config) * (1 if config.model.tie_embeddings else 2)


def non_embedding_parameters(config: RunConfig) -> int:
    """``total_parameters`` less ``vocabulary_parameters`` (the scaling-law ``N``)."""
    return total_parameters(config) - vocabulary_parameters(config)
