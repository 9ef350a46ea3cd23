"""Full Megatron state dict <-> transformers' native ``GPT2LMHeadModel`` tensors.

Standard attention in the GPT-2 family (learned absolute positions, LayerNorm, an exact
GELU MLP, biases in every projection, multi-head attention) is exactly GPT-2, so it exports
to ``GPT2LMHeadModel`` with no remote code. GPT-2 keeps its projections as ``Conv1D``
(weights stored ``[in, out]``, the transpose of a ``Linear``) and concatenates
``[q; k; v]`` in ``c_attn``, where Megatron groups the rows per head (``names.split_qkv``).
"""

from __future__ import annotations

import torch

from cqk_megatron.convert.errors import ConversionError
from cqk_megatron.convert.names import (
    MEGATRON_LAYER,
    ModelShape,
    fuse_qkv,
    layer_split,
    split_qkv,
)

GPT2_LAYER = "transformer.h.{}."

_GLOBAL = {
    "embedding.word_embeddings.weight": "transformer.wte.weight",
    "embedding.position_embeddings.weight": "transformer.wpe.weight",
    "decoder.final_layernorm.weight": "transformer.ln_f.weight",
    "decoder.final_layernorm.bias": "transformer.ln_f.bias",
    "output_layer.weight": "lm_head.weight",
}
# Megatron suffix -> (GPT-2 suffix, transposed: a Conv1D weight)
_LAYER = {
    "input_layernorm.weight": ("ln_1.weight", False),
    "input_layernorm.bias": ("ln_1.bias", False),
    "self_attention.linear_proj.weight": ("attn.c_proj.weight", True),
    "self_attention.linear_proj.bias": ("attn.c_proj.bias", False),
    "pre_mlp_layernorm.weight": ("ln_2.weight", False),
    "pre_mlp_layernorm.bias": ("ln_2.bias", False),
    "mlp.linear_fc1.weight": ("mlp.c_fc.weight", True),
    "mlp.linear_fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.linear_fc2.weight": ("mlp.c_proj.weight", True),
    "mlp.linear_fc2.bias": ("mlp.c_proj.bias", False),
}
_QKV = "self_attention.linear_qkv."
_C_ATTN = "attn.c_attn."


def megatron_to_gpt2(state: dict[str, torch.Tensor], shape: ModelShape) -> dict:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = tensor
            continue
        index, suffix = layer_split(name, MEGATRON_LAYER)
        prefix = GPT2_LAYER.format(index)
        if index is not None and suffix.startswith(_QKV):
            kind = suffix[len(_QKV) :]
            q, k, v = split_qkv(tensor, shape)
            fused = torch.cat([q, k, v], dim=0)
            out[prefix + _C_ATTN + kind] = fused.t().contiguous() if kind == "weight" else fused
        elif index is not None and suffix in _LAYER:
            target, transposed = _LAYER[suffix]
            out[prefix + target] = tensor.t().contiguous() if transposed else tensor
        else:
            raise ConversionError(f"no GPT-2 counterpart for Megatron tensor '{name}'")
    return out


def gpt2_to_megatron(tensors: dict[str, torch.Tensor], shape: ModelShape) -> dict:
    global_back = {hf: meg for meg, hf in _GLOBAL.items()}
    layer_back = {hf: (meg, t) for meg, (hf, t) in _LAYER.items()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in global_back:
            out[global_back[name]] = tensor
            continue
        index, suffix = layer_split(name, GPT2_LAYER)
        if index is None:
            raise ConversionError(f"unexpected tensor '{name}' in the GPT-2 weights")
        prefix = MEGATRON_LAYER.format(index)
        if suffix in ("attn.bias", "attn.masked_bias"):
            continue  # older GPT-2 files store the causal mask as a buffer
        if suffix.startswith(_C_ATTN):
            kind = suffix[len(_C_ATTN) :]
            fused = tensor.t() if kind == "weight" else tensor
            q, k, v = fused.chunk(3, dim=0)
            out[prefix + _QKV + kind] = fuse_qkv(q, k, v, shape)
        elif suffix in layer_back:
            target, transposed = layer_back[suffix]
            out[prefix + target] = tensor.t().contiguous() if transposed else tensor
        else:
            raise ConversionError(f"unexpected tensor '{name}' in the GPT-2 weights")
    return out
