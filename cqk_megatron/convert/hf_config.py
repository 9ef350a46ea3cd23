"""``RunConfig`` <-> Hugging Face ``config.json``.

Standard attention with RMSNorm, SwiGLU and RoPE is exactly Llama, so it exports to
transformers' own ``LlamaForCausalLM`` (no remote code); standard attention in the GPT-2
family (learned positions, LayerNorm, GELU, biases, multi-head) is exactly GPT-2 and exports
to ``GPT2LMHeadModel``. Everything else exports to the custom ``CQKForCausalLM``
(``hf_remote/``) registered through ``auto_map``. The full
``RunConfig`` also travels in the folder (``cqk_run_config.yaml``), so importing our own
export gives the same config back; a foreign Llama folder gets a config derived from its
``config.json``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cqk_megatron.config import COUPLINGS, SCORINGS, RunConfig
from cqk_megatron.convert.errors import ConversionError
from cqk_megatron.convert.remote_source import export_fields, variant_source
from cqk_megatron.model.specs import coupling_spec
from cqk_megatron.variants import COUPLING_POSITIONS, UnknownVariantError, coupling, scoring

LLAMA = "llama"
GPT2 = "gpt2"
CQK = "cqk"
CQK_AUTO_MAP = {
    "AutoConfig": "configuration_cqk.CQKConfig",
    "AutoModelForCausalLM": "modeling_cqk.CQKForCausalLM",
}
# What exports: every registered coupling and scoring (the registry's live views), whose
# classes the folder ships (``remote_source``); anything else is refused at export time.
EXPORTABLE_COUPLINGS = COUPLINGS
EXPORTABLE_SCORINGS = SCORINGS
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def is_llama_compatible(config: RunConfig) -> bool:
    """Whether transformers' Llama computes exactly this model."""
    m, a = config.model, config.attention
    return (
        a.coupling == "none"
        and a.scoring == "standard"
        and m.normalization == "RMSNorm"
        and m.swiglu
        and m.position_embedding_type == "rope"
        and not m.add_bias_linear
    )


def is_gpt2_compatible(config: RunConfig) -> bool:
    """Whether transformers' GPT-2 computes exactly this model."""
    m, a = config.model, config.attention
    return (
        a.coupling == "none"
        and a.scoring == "standard"
        and m.normalization == "LayerNorm"
        and not m.swiglu
        and m.position_embedding_type == "learned_absolute"
        and m.add_bias_linear
        and m.kv_heads == m.num_attention_heads
    )


def native_model_type(config: RunConfig) -> str | None:
    """``llama`` or ``gpt2`` where a native transformers class is exact, else None."""
    if is_llama_compatible(config):
        return LLAMA
    if is_gpt2_compatible(config):
        return GPT2
    return None


def check_exportable(config: RunConfig) -> None:
    """Refuse a variant that the exporter (and its modeling code) does not know, or whose
    classes it cannot ship."""
    a, m = config.attention, config.model
    try:
        coupling(a.coupling), scoring(a.scoring)
    except UnknownVariantError as error:  # the registry's one message for the name
        raise ConversionError(str(error)) from None
    if a.coupling not in EXPORTABLE_COUPLINGS or a.scoring not in EXPORTABLE_SCORINGS:
        raise ConversionError(
            f"variant {a.variant!r} (attention.coupling={a.coupling!r}, "
            f"attention.scoring={a.scoring!r}) is unknown to the Hugging Face exporter; it "
            f"exports couplings {list(EXPORTABLE_COUPLINGS)} and scorings "
            f"{list(EXPORTABLE_SCORINGS)}"
        )
    variant_source(config)  # refuses a class whose source cannot travel
    if a.position not in COUPLING_POSITIONS:
        raise ConversionError(f"attention.position={a.position!r} is unknown to the exporter")
    if m.normalization not in ("RMSNorm", "LayerNorm"):
        raise ConversionError(f"model.normalization={m.normalization!r} is unknown to the exporter")
    if m.position_embedding_type not in ("rope", "learned_absolute"):
        raise ConversionError(
            f"model.position_embedding_type={m.position_embedding_type!r} is unknown to the "
            "exporter"
        )


def _token_ids(special_ids: dict[str, int | None]) -> dict[str, int | None]:
    """bos/eos/pad ids, None where the tokenizer has none (no Llama defaults of 1 and 2)."""
    return {f"{name}_token_id": special_ids.get(name) for name in ("bos", "eos", "pad")}


def hf_config_dict(
    config: RunConfig, dtype: torch.dtype, special_ids: dict[str, int | None]
) -> dict[str, Any]:
    """The ``config.json`` contents for ``config`` (weights saved in ``dtype``)."""
    check_exportable(config)
    m = config.model
    shape = {
        "vocab_size": m.padded_vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "max_position_embeddings": m.seq_length,
        "initializer_range": m.init_method_std,
        "tie_word_embeddings": m.tie_embeddings,
        "dtype": DTYPE_NAMES[dtype],
        "use_cache": True,
        **_token_ids(special_ids),
    }
    if is_llama_compatible(config):
        return _llama_config_dict(config, shape)
    if is_gpt2_compatible(config):
        return _gpt2_config_dict(config, shape)
    spec = coupling_spec(config.attention, m.head_dim)
    return {
        "architectures": ["CQKForCausalLM"],
        "model_type": CQK,
        "auto_map": dict(CQK_AUTO_MAP),
        **shape,
        "rotary_base": float(m.rotary_base),
        "normalization": m.normalization,
        "norm_eps": m.layernorm_epsilon,
        "mlp_activation": "swiglu" if m.swiglu else "gelu",
        "position_embedding_type": m.position_embedding_type,
        "linear_bias": m.add_bias_linear,
        "coupling": config.attention.coupling,
        "coupling_options": {} if spec is None else dict(spec.params),
        "coupling_position": config.attention.position,
        "scoring": config.attention.scoring,
        **export_fields(config),
    }


def _llama_config_dict(config: RunConfig, shape: dict[str, Any]) -> dict[str, Any]:
    """Built by transformers' own ``LlamaConfig``, so the file suits the installed version."""
    from transformers import LlamaConfig

    m = config.model
    llama = LlamaConfig(
        **{k: v for k, v in shape.items() if k != "dtype"},
        rms_norm_eps=m.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)},
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
    )
    data = llama.to_dict()
    data["architectures"] = ["LlamaForCausalLM"]
    data["dtype"] = shape["dtype"]
    return data


def _gpt2_config_dict(config: RunConfig, shape: dict[str, Any]) -> dict[str, Any]:
    """Built by transformers' own ``GPT2Config``; ``gelu`` is the exact (erf) GELU that
    Megatron's MLP applies (GPT-2's own ``gelu_new`` is the tanh approximation)."""
    from transformers import GPT2Config

    m = config.model
    gpt2 = GPT2Config(
        vocab_size=shape["vocab_size"],
        n_positions=m.seq_length,
        n_embd=m.hidden_size,
        n_layer=m.num_layers,
        n_head=m.num_attention_heads,
        n_inner=m.ffn_size,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=m.layernorm_epsilon,
        initializer_range=m.init_method_std,
        scale_attn_weights=True,
        tie_word_embeddings=m.tie_embeddings,
        use_cache=True,
        # GPT2Config's defaults are GPT-2's own 50256; the tokenizer's ids (or None) instead
        **{k: shape[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    data = gpt2.to_dict()
    data["architectures"] = ["GPT2LMHeadModel"]
    data["dtype"] = shape["dtype"]
    return data


# --- import -------------------------------------------------------------------------------


def run_config_from_llama(hf: dict[str, Any], source: str) -> RunConfig:
    """A ``RunConfig`` for a native Llama ``config.json`` (standard attention)."""

    def need(key: str, allowed: tuple, default: Any) -> None:
        value = hf.get(key, default)
        if value not in allowed:
            raise ConversionError(
                f"{source}: {key}={value!r} has no counterpart in cqk-megatron's model "
                f"(supported: {list(allowed)})"
            )

    need("hidden_act", ("silu",), "silu")
    need("attention_bias", (False,), False)
    need("mlp_bias", (False,), False)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    need_rope = rope.get("rope_type", rope.get("type", "default"))
    if need_rope != "default":
        raise ConversionError(
            f"{source}: RoPE scaling {need_rope!r} is not supported; only default"
        )
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    try:
        heads, hidden, vocab = hf["num_attention_heads"], hf["hidden_size"], hf["vocab_size"]
        layers, ffn = hf["num_hidden_layers"], hf["intermediate_size"]
    except KeyError as error:
        raise ConversionError(f"{source}: config.json lacks {error.args[0]!r}") from error
    head_dim = hf.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise ConversionError(
            f"{source}: head_dim={head_dim} x num_attention_heads={heads} != hidden_size="
            f"{hidden}; cqk-megatron needs hidden_size = heads x head_dim"
        )
    kv_heads = hf.get("num_key_value_heads") or heads
    config = RunConfig()
    m = config.model
    m.num_layers, m.hidden_size, m.num_attention_heads = layers, hidden, heads
    m.num_query_groups = None if kv_heads == heads else kv_heads
    m.ffn_hidden_size, m.vocab_size = ffn, vocab
    # Pad by the largest power of two up to 128 dividing the vocabulary: no padding rows.
    m.make_vocab_size_divisible_by = math.gcd(vocab, 128)
    m.seq_length = hf.get("max_position_embeddings", m.seq_length)
    m.rotary_base = int(theta) if float(theta).is_integer() else theta
    m.tie_embeddings = bool(hf.get("tie_word_embeddings", False))
    m.layernorm_epsilon = float(hf.get("rms_norm_eps", 1e-6))
    m.normalization, m.swiglu = "RMSNorm", True
    m.init_method_std = float(hf.get("initializer_range", m.init_method_std))
    return config


def run_config_from_gpt2(hf: dict[str, Any], source: str) -> RunConfig:
    """A ``RunConfig`` (GPT-2 family, standard attention) for a native GPT-2 ``config.json``."""
    activation = hf.get("activation_function", "gelu_new")
    if activation != "gelu":
        raise ConversionError(
            f"{source}: activation_function={activation!r} has no counterpart in cqk-megatron, "
            "whose GPT-2 family applies the exact GELU ('gelu'); GPT-2's own 'gelu_new' is "
            "the tanh approximation"
        )
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(key):
            raise ConversionError(f"{source}: {key}=true is not supported")
    try:
        heads, hidden, layers = hf["n_head"], hf["n_embd"], hf["n_layer"]
        vocab, positions = hf["vocab_size"], hf["n_positions"]
    except KeyError as error:
        raise ConversionError(f"{source}: config.json lacks {error.args[0]!r}") from error
    config = RunConfig()
    m = config.model
    m.family = GPT2
    m.normalization, m.swiglu = "LayerNorm", False
    m.position_embedding_type, m.add_bias_linear = "learned_absolute", True
    m.num_layers, m.hidden_size, m.num_attention_heads = layers, hidden, heads
    m.ffn_hidden_size = hf.get("n_inner") or 4 * hidden
    m.vocab_size, m.make_vocab_size_divisible_by = vocab, math.gcd(vocab, 128)
    m.seq_length = positions
    m.tie_embeddings = bool(hf.get("tie_word_embeddings", True))
    m.layernorm_epsilon = float(hf.get("layer_norm_epsilon", 1e-5))
    m.init_method_std = float(hf.get("initializer_range", m.init_method_std))
    return config


def check_config_agrees(config: RunConfig, hf: dict[str, Any], source: str) -> None:
    """The saved ``RunConfig`` and ``config.json`` must describe the same model."""
    m = config.model
    pairs = {
        "vocab_size": m.padded_vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "intermediate_size": m.ffn_size,
    }
    if hf.get("model_type") == GPT2:
        pairs = {
            "vocab_size": m.padded_vocab_size,
            "n_embd": m.hidden_size,
            "n_layer": m.num_layers,
            "n_head": m.num_attention_heads,
            "n_inner": m.ffn_size,
            "n_positions": m.seq_length,
        }
    wrong = [f"{k}={hf.get(k)!r} vs {v}" for k, v in pairs.items() if hf.get(k) != v]
    if hf.get("model_type") == CQK:
        for key, value in (
            ("coupling", config.attention.coupling),
            ("scoring", config.attention.scoring),
        ):
            if hf.get(key) != value:
                wrong.append(f"{key}={hf.get(key)!r} vs {value!r}")
    if wrong:
        raise ConversionError(
            f"{source}: config.json and cqk_run_config.yaml disagree ({'; '.join(wrong)}); "
            "the folder was edited by hand: restore one from the other"
        )


def run_config_from_cqk(hf: dict[str, Any], source: str) -> RunConfig:
    """A ``RunConfig`` for our custom ``config.json`` when ``cqk_run_config.yaml`` is gone."""
    coupling_name, scoring_name = hf.get("coupling", "none"), hf.get("scoring", "standard")
    try:
        variant = coupling(coupling_name)
        scoring_variant = scoring(scoring_name)
    except UnknownVariantError as error:
        raise ConversionError(f"{source}: {error}") from None
    llama_like = {**hf, "rms_norm_eps": hf.get("norm_eps", 1e-5)}
    llama_like["rope_parameters"] = {"rope_type": "default", "rope_theta": hf.get("rotary_base")}
    config = run_config_from_llama(llama_like, source)
    config.model.normalization = hf.get("normalization", "RMSNorm")
    config.model.swiglu = hf.get("mlp_activation", "swiglu") == "swiglu"
    config.model.position_embedding_type = hf.get("position_embedding_type", "rope")
    config.model.add_bias_linear = bool(hf.get("linear_bias", False))
    a = config.attention
    a.coupling, a.scoring = coupling_name, scoring_name
    a.position = hf.get("coupling_position", "pre_rope")
    options = dict(hf.get("coupling_options") or {})
    scoring_options = dict(hf.get("scoring_options") or {})
    try:  # the constructor keywords, back to the AttentionConfig fields they are
        fields = variant.attention_fields(options, f"{source}: coupling_options")
        fields |= scoring_variant.attention_fields(scoring_options, f"{source}: scoring_options")
    except ValueError as error:
        raise ConversionError(str(error)) from None
    for field, value in fields.items():
        setattr(a, field, value)
    return config
