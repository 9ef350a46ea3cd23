"""Parameter names and fused-tensor splits: full Megatron state dict <-> Hugging Face.

The Megatron side is the full model (TP=1, PP=1) as ``GPTModel.named_parameters()``
names it with the local layer spec. The Hugging Face side uses Llama's names, plus
``self_attn.coupling.*`` and ``self_attn.differential.*`` for the custom architecture,
whose module trees are the very classes of ``plain_math.py``, so their names carry over.

Two fused Megatron tensors are split (and fused back):

- ``linear_qkv``: rows grouped per query group, ``[q_1 .. q_g, k, v]`` for each of the
  ``num_query_groups`` groups, every block ``head_dim`` rows;
- ``linear_fc1`` with SwiGLU: ``[gate; up]``.

Biases (``model.add_bias_linear``) follow their weights' rows; the learned position table
(``model.position_embedding_type=learned_absolute``) is ``model.embed_positions``. The
native GPT-2 names of standard attention are ``gpt2_names.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cqk_megatron.config import RunConfig
from cqk_megatron.convert.errors import ConversionError
from cqk_megatron.model.specs import coupling_spec
from cqk_megatron.variants import scoring as registered_scoring

MEGATRON_LAYER = "decoder.layers.{}."
HF_LAYER = "model.layers.{}."

# Per-layer tensors that are renamed only (Megatron suffix -> Hugging Face suffix).
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.bias": "post_attention_layernorm.bias",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}
# Per-layer submodules whose parameters keep their names below a renamed prefix.
_LAYER_PREFIXES = {
    "self_attention.coupling.": "self_attn.coupling.",
    "self_attention.core_attention.differential.": "self_attn.differential.",
}
_GLOBAL_RENAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "embedding.position_embeddings.weight": "model.embed_positions.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "decoder.final_layernorm.bias": "model.norm.bias",
    "output_layer.weight": "lm_head.weight",
}
# Transformer Engine fuses the pre-attention and pre-MLP norms into the next linear.
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


@dataclass(frozen=True)
class ModelShape:
    """The shape facts that name and split the tensors."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int  # padded, as the embedding holds it
    gated_mlp: bool
    norm_bias: bool
    tie_embeddings: bool
    linear_bias: bool = False  # biases in QKV, attention output, fc1 and fc2
    learned_positions: bool = False  # a [seq_length, hidden] position table
    max_positions: int = 0

    @classmethod
    def from_run_config(cls, config: RunConfig) -> ModelShape:
        m = config.model
        return cls(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_heads=m.num_attention_heads,
            num_kv_heads=m.kv_heads,
            head_dim=m.head_dim,
            ffn_size=m.ffn_size,
            vocab_size=m.padded_vocab_size,
            gated_mlp=m.swiglu,
            norm_bias=m.normalization == "LayerNorm",
            tie_embeddings=m.tie_embeddings,
            linear_bias=m.add_bias_linear,
            learned_positions=m.position_embedding_type == "learned_absolute",
            max_positions=m.seq_length,
        )

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


# --- QKV and fc1 ----------------------------------------------------------------------------


def split_qkv(fused: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, ...]:
    """Megatron's grouped ``linear_qkv`` weight -> ``(q_proj, k_proj, v_proj)`` weights."""
    groups, g, d = shape.num_kv_heads, shape.group_size, shape.head_dim
    rows = groups * (g + 2) * d
    expected = (rows, shape.hidden_size) if fused.dim() == 2 else (rows,)  # weight, bias
    if tuple(fused.shape) != expected:
        raise ConversionError(
            f"linear_qkv tensor has shape {tuple(fused.shape)}, expected {expected}"
        )
    tail = tuple(fused.shape[1:])
    blocks = fused.reshape(groups, g + 2, d, *tail)
    q = blocks[:, :g].reshape(groups * g * d, *tail)
    k = blocks[:, g].reshape(groups * d, *tail)
    v = blocks[:, g + 1].reshape(groups * d, *tail)
    return q.contiguous(), k.contiguous(), v.contiguous()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """``(q_proj, k_proj, v_proj)`` weights -> Megatron's grouped ``linear_qkv`` weight."""
    groups, g, d = shape.num_kv_heads, shape.group_size, shape.head_dim
    tail = tuple(q.shape[1:])  # (hidden,) for weights, () for biases
    q = q.reshape(groups, g, d, *tail)
    k = k.reshape(groups, 1, d, *tail)
    v = v.reshape(groups, 1, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(groups * (g + 2) * d, *tail).contiguous()


# --- whole state dicts --------------------------------------------------------------------


def canonical_megatron_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop ``_extra_state`` entries and rename Transformer Engine's fused-norm tensors."""
    canonical = {}
    for name, tensor in state.items():
        if name.endswith("._extra_state") or not isinstance(tensor, torch.Tensor):
            continue
        for te_suffix, local_suffix in _TE_ALIASES.items():
            if name.endswith(te_suffix):
                name = name[: -len(te_suffix)] + local_suffix
                break
        canonical[name] = tensor
    return canonical


def megatron_to_hf(state: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Full Megatron state dict -> Hugging Face tensors (names checked by the caller)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in _GLOBAL_RENAMES:
            out[_GLOBAL_RENAMES[name]] = tensor
            continue
        index, suffix = layer_split(name, MEGATRON_LAYER)
        if index is None:
            raise ConversionError(f"unexpected tensor '{name}' in the Megatron state dict")
        hf = HF_LAYER.format(index)
        kind = suffix.rsplit(".", 1)[-1]  # weight | bias
        if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            q, k, v = split_qkv(tensor, shape)
            out[hf + f"self_attn.q_proj.{kind}"] = q
            out[hf + f"self_attn.k_proj.{kind}"] = k
            out[hf + f"self_attn.v_proj.{kind}"] = v
        elif suffix in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
            if shape.gated_mlp:
                gate, up = tensor.chunk(2, dim=0)
                out[hf + f"mlp.gate_proj.{kind}"] = gate.contiguous()
                out[hf + f"mlp.up_proj.{kind}"] = up.contiguous()
            else:
                out[hf + f"mlp.up_proj.{kind}"] = tensor
        elif suffix in _LAYER_RENAMES:
            out[hf + _LAYER_RENAMES[suffix]] = tensor
        else:
            out[hf + _rename_prefix(name, suffix, _LAYER_PREFIXES)] = tensor
    return out


def hf_to_megatron(tensors: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> full Megatron state dict (names checked by the caller)."""
    global_back = {hf: meg for meg, hf in _GLOBAL_RENAMES.items()}
    layer_back = {hf: meg for meg, hf in _LAYER_RENAMES.items()}
    prefix_back = {hf: meg for meg, hf in _LAYER_PREFIXES.items()}
    out: dict[str, torch.Tensor] = {}
    fused_parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if name in global_back:
            out[global_back[name]] = tensor
            continue
        index, suffix = layer_split(name, HF_LAYER)
        if index is None:
            raise ConversionError(f"unexpected tensor '{name}' in the Hugging Face weights")
        meg = MEGATRON_LAYER.format(index)
        kind = suffix.rsplit(".", 1)[-1]  # weight | bias
        if suffix.rsplit(".", 1)[0] in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            fused_parts.setdefault((index, f"qkv.{kind}"), {})[suffix.split(".")[1][0]] = tensor
        elif suffix.rsplit(".", 1)[0] in ("mlp.gate_proj", "mlp.up_proj") and shape.gated_mlp:
            fused_parts.setdefault((index, f"fc1.{kind}"), {})[suffix.split(".")[1]] = tensor
        elif suffix in ("mlp.up_proj.weight", "mlp.up_proj.bias"):
            out[meg + f"mlp.linear_fc1.{kind}"] = tensor
        elif suffix in layer_back:
            out[meg + layer_back[suffix]] = tensor
        else:
            out[meg + _rename_prefix(name, suffix, prefix_back)] = tensor
    for (index, fused), parts in sorted(fused_parts.items()):
        meg = MEGATRON_LAYER.format(index)
        what, kind = fused.split(".")
        if what == "qkv":
            _require_parts(parts, ("q", "k", "v"), f"{HF_LAYER.format(index)}self_attn.*_proj")
            out[meg + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(
                parts["q"], parts["k"], parts["v"], shape
            )
        else:
            _require_parts(parts, ("gate_proj", "up_proj"), f"{HF_LAYER.format(index)}mlp")
            out[meg + f"mlp.linear_fc1.{kind}"] = torch.cat(
                [parts["gate_proj"], parts["up_proj"]], dim=0
            ).contiguous()
    return out


def layer_split(name: str, pattern: str) -> tuple[int | None, str]:
    """``(layer index, the name's rest)`` for a name under ``pattern``'s layer prefix
    (``decoder.layers.{}.``), else ``(None, name)``."""
    head = pattern.split("{}")[0]
    if not name.startswith(head):
        return None, name
    index, _, suffix = name[len(head) :].partition(".")
    if not index.isdigit():
        return None, name
    return int(index), suffix


def _rename_prefix(name: str, suffix: str, prefixes: dict[str, str]) -> str:
    for source, target in prefixes.items():
        if suffix.startswith(source):
            return target + suffix[len(source) :]
    raise ConversionError(f"no conversion rule for tensor '{name}'")


def _require_parts(parts: dict, names: tuple[str, ...], where: str) -> None:
    missing = [n for n in names if n not in parts]
    if missing:
        raise ConversionError(f"{where}: missing {missing} to fuse; the weights are incomplete")


# --- what a config's model holds ----------------------------------------------------------


def megatron_param_shapes(config: RunConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the full model's parameters, from the config alone.

    The coupling and differential entries come from instantiating the very modules of
    ``plain_math.py`` with the options the layer spec gives them, so a new coupling class
    needs no change here.
    """
    m, shape = config.model, ModelShape.from_run_config(config)
    hidden, d = shape.hidden_size, shape.head_dim
    norm = {"weight": (hidden,), **({"bias": (hidden,)} if shape.norm_bias else {})}
    shapes: dict[str, tuple[int, ...]] = {
        "embedding.word_embeddings.weight": (shape.vocab_size, hidden),
        **{f"decoder.final_layernorm.{k}": v for k, v in norm.items()},
    }
    if not shape.tie_embeddings:
        shapes["output_layer.weight"] = (shape.vocab_size, hidden)
    if shape.learned_positions:
        shapes["embedding.position_embeddings.weight"] = (shape.max_positions, hidden)
    extra = _attention_extras(config)
    for index in range(m.num_layers):
        layer = MEGATRON_LAYER.format(index)
        for k, v in norm.items():
            shapes[f"{layer}input_layernorm.{k}"] = v
            shapes[f"{layer}pre_mlp_layernorm.{k}"] = v
        qkv_rows = (shape.num_heads + 2 * shape.num_kv_heads) * d
        shapes[f"{layer}self_attention.linear_qkv.weight"] = (qkv_rows, hidden)
        shapes[f"{layer}self_attention.linear_proj.weight"] = (hidden, shape.num_heads * d)
        fc1_rows = shape.ffn_size * (2 if shape.gated_mlp else 1)
        shapes[f"{layer}mlp.linear_fc1.weight"] = (fc1_rows, hidden)
        shapes[f"{layer}mlp.linear_fc2.weight"] = (hidden, shape.ffn_size)
        if shape.linear_bias:
            shapes[f"{layer}self_attention.linear_qkv.bias"] = (qkv_rows,)
            shapes[f"{layer}self_attention.linear_proj.bias"] = (hidden,)
            shapes[f"{layer}mlp.linear_fc1.bias"] = (fc1_rows,)
            shapes[f"{layer}mlp.linear_fc2.bias"] = (hidden,)
        shapes.update({layer + name: shape for name, shape in extra.items()})
    return shapes


def _attention_extras(config: RunConfig) -> dict[str, tuple[int, ...]]:
    head_dim = config.model.head_dim
    extras: dict[str, tuple[int, ...]] = {}
    spec = coupling_spec(config.attention, head_dim)
    if spec is not None:
        for name, param in spec.module(head_dim=head_dim, **spec.params).named_parameters():
            extras[f"self_attention.coupling.{name}"] = tuple(param.shape)
    scoring = registered_scoring(config.attention.scoring)
    math = scoring.math_class()
    if math is not None:  # the core attention holds it as its ``math_attribute``
        prefix = f"self_attention.core_attention.{scoring.math_attribute}."
        options = scoring.constructor_options(config.attention)
        for name, param in math(head_dim, layer_index=0, **options).named_parameters():
            extras[prefix + name] = tuple(param.shape)
    return extras


def check_megatron_state(state: dict[str, torch.Tensor], config: RunConfig, source: str) -> None:
    """Refuse a state dict whose names or shapes are not the config's model."""
    expected = megatron_param_shapes(config)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(
        f"{name}: {tuple(state[name].shape)} instead of {shape}"
        for name, shape in expected.items()
        if name in state and tuple(state[name].shape) != shape
    )
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s), e.g. {unexpected[:3]}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) of the wrong shape, e.g. {wrong[:3]}")
    if problems:
        raise ConversionError(
            f"{source} does not hold the model its config describes "
            f"(variant {config.attention.variant}, {config.model.num_layers} layers, hidden "
            f"{config.model.hidden_size}): "
            + "; ".join(problems)
            + ". Use the config.yaml saved with this checkpoint."
        )
