"""The two kinds of model the MQAR trainer runs, behind one call.

- the project's Megatron ``GPTModel`` built from a ``RunConfig`` (``build_megatron``);
- the independent plain-PyTorch ``PlainLM`` (``plain_model.py``).

``query_logits(model, tokens, mask)`` returns the logits at the labelled positions only
(``[n, vocab]``, in the row-major order of ``mask``): MQAR scores a few query positions per
sequence, so the output layer and the softmax run on those rows alone, which is the same
loss at a third less compute. ``plain_state_from_megatron`` maps a Megatron state dict
onto a ``PlainLM`` of the same architecture (``plain_config_for``), for the checks on
identical weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from cqk_megatron.config import RunConfig
from cqk_megatron.eval.mqar_options import REINIT_PARTS
from cqk_megatron.eval.plain_model import COUPLINGS as PLAIN_COUPLINGS
from cqk_megatron.eval.plain_model import PlainConfig, PlainLM


def build_megatron(config: RunConfig) -> torch.nn.Module:
    """The project's model for ``config`` on one process (sets up Megatron's state)."""
    from cqk_megatron.model.gpt import build_model
    from cqk_megatron.parallel.process_groups import init_single_process

    init_single_process(config)
    return build_model(config)


@contextlib.contextmanager
def _output_rows(model: torch.nn.Module, mask: torch.Tensor):
    """Feed the Megatron output layer only the hidden states where ``mask`` is set."""

    def select(_module, args, kwargs):
        hidden = args[0]  # [s, b, h]
        rows = hidden.transpose(0, 1)[mask]  # [n, h], ordered like mask.nonzero()
        return (rows.unsqueeze(1), *args[1:]), kwargs

    handle = model.output_layer.register_forward_pre_hook(select, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def query_logits(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits ``[n, vocab]`` at the positions where ``mask`` (``[b, s]`` bool) is set."""
    if isinstance(model, PlainLM):
        return model.logits(model.hidden_states(tokens)[mask])
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    with _output_rows(model, mask):
        logits = model(tokens, positions, None)  # [1, n, vocab]
    return logits.squeeze(0)


def dt_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The coupling step-size parameters (``dt``'s raw value) of either kind of model."""
    if isinstance(model, PlainLM):
        return model.dt_parameters()
    return [p for name, p in model.named_parameters() if name.endswith("coupling.dt.raw")]


@torch.no_grad()
def reinit_like_torch(model: torch.nn.Module, part: str = "torch") -> None:
    """Redraw a (TP=1) Megatron model's weights from PyTorch's module defaults: ``torch``
    every embedding and linear weight, ``torch_embeddings`` / ``torch_linears`` one kind.
    Norms keep ones and zeros; the coupling keeps its own (PyTorch's) initialisation."""
    if part not in REINIT_PARTS:
        raise ValueError(f"reinit part {part!r}; choose one of {list(REINIT_PARTS)}")
    params = dict(model.named_parameters())
    for name, param in params.items():
        if ".coupling." in name or "layernorm" in name:
            continue
        embedding = name.startswith("embedding.")
        if part == "torch_embeddings" and not embedding:
            continue
        if part == "torch_linears" and embedding:
            continue
        if embedding:
            param.normal_(0.0, 1.0)
        elif param.dim() == 2:  # [out, in]: fused QKV and gate/up rows share one fan-in
            bound = 1 / math.sqrt(param.shape[1])
            param.uniform_(-bound, bound)
        elif name.endswith(".bias"):
            bound = 1 / math.sqrt(params[name[: -len("bias")] + "weight"].shape[1])
            param.uniform_(-bound, bound)


# --- the project's model as a PlainLM ------------------------------------------------------


def plain_config_for(config: RunConfig) -> PlainConfig:
    """The ``PlainConfig`` computing the same function as ``config``'s Megatron model."""
    m, a = config.model, config.attention
    if a.scoring not in ("standard", "differential"):
        raise ValueError(f"attention.scoring={a.scoring!r} has no plain form")
    if a.coupling not in PLAIN_COUPLINGS:
        raise ValueError(
            f"attention.coupling={a.coupling!r} has no plain form (eval/plain_model.py writes "
            f"out {list(PLAIN_COUPLINGS)})"
        )
    return PlainConfig(
        vocab_size=m.padded_vocab_size,
        hidden=m.hidden_size,
        layers=m.num_layers,
        heads=m.num_attention_heads,
        kv_heads=m.kv_heads,
        seq_len=m.seq_length,
        ffn=m.ffn_size,
        norm="rmsnorm" if m.normalization == "RMSNorm" else "layernorm",
        norm_eps=m.layernorm_epsilon,
        mlp="swiglu" if m.swiglu else "gelu",
        bias=m.add_bias_linear,
        positions="rope" if m.position_embedding_type == "rope" else "learned",
        rotary_base=float(m.rotary_base),
        tie_embeddings=m.tie_embeddings,
        init="gpt2",
        coupling=a.coupling,  # the registry's names are the plain model's
        coupling_position=a.position,
        steps=a.steps,
        f_hidden=a.coupling_hidden,
        f_output_bias=False,
        dt_param="softplus",
        dt_init=a.dt_init,
        invertible_layers=a.invertible_layers,
        invertible_bound=a.invertible_scale_bound,
        scoring=a.scoring,
        differential_norm=a.differential_norm,
        differential_lambda_init=a.differential_lambda_init,
    )


def _split_rows(tensor: torch.Tensor, config: RunConfig) -> tuple[torch.Tensor, ...]:
    """Megatron's grouped QKV rows ``[q_1..q_g, k, v]`` per group -> ``(q, k, v)`` rows."""
    m = config.model
    groups, g, d = m.kv_heads, m.num_attention_heads // m.kv_heads, m.head_dim
    blocks = tensor.reshape(groups, g + 2, d, *tensor.shape[1:])
    q = blocks[:, :g].reshape(groups * g * d, *tensor.shape[1:])
    k = blocks[:, g].reshape(groups * d, *tensor.shape[1:])
    v = blocks[:, g + 1].reshape(groups * d, *tensor.shape[1:])
    return q, k, v


_RENAMES = {
    "input_layernorm": "norm1",
    "pre_mlp_layernorm": "norm2",
    "self_attention.linear_proj": "attn.o",
    "mlp.linear_fc2": "mlp.down",
}


def plain_state_from_megatron(state: dict[str, torch.Tensor], config: RunConfig) -> dict:
    """A full (TP=1, PP=1) Megatron state dict under ``PlainLM``'s names."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith("_extra_state") or not isinstance(tensor, torch.Tensor):
            continue
        if name == "embedding.word_embeddings.weight":
            out["tok_emb.weight"] = tensor
        elif name == "embedding.position_embeddings.weight":
            out["pos_emb.weight"] = tensor
        elif name.startswith("decoder.final_layernorm."):
            out["final_norm." + name.rsplit(".", 1)[1]] = tensor
        elif name == "output_layer.weight":
            out["head.weight"] = tensor
        elif name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers.") :].split(".", 1)
            out.update(_layer_tensor(f"blocks.{index}.", rest, tensor, config))
        else:
            raise KeyError(f"no plain counterpart for Megatron tensor {name!r}")
    return out


def _layer_tensor(prefix: str, rest: str, tensor: torch.Tensor, config: RunConfig) -> dict:
    module, kind = rest.rsplit(".", 1)
    if module == "self_attention.linear_qkv":
        q, k, v = _split_rows(tensor, config)
        return {
            f"{prefix}attn.q.{kind}": q,
            f"{prefix}attn.k.{kind}": k,
            f"{prefix}attn.v.{kind}": v,
        }
    if module == "mlp.linear_fc1":
        if config.model.swiglu:
            gate, up = tensor.chunk(2, dim=0)
            return {f"{prefix}mlp.gate.{kind}": gate, f"{prefix}mlp.up.{kind}": up}
        return {f"{prefix}mlp.up.{kind}": tensor}
    if module in _RENAMES:
        return {f"{prefix}{_RENAMES[module]}.{kind}": tensor}
    if rest.startswith("self_attention.core_attention.differential."):
        inner = rest[len("self_attention.core_attention.differential.") :]
        return {f"{prefix}attn.differential.{inner}": tensor}
    if rest.startswith("self_attention.coupling."):
        inner = rest[len("self_attention.coupling.") :]
        return {f"{prefix}attn.coupling.{'dt_raw' if inner == 'dt.raw' else inner}": tensor}
    raise KeyError(f"no plain counterpart for Megatron tensor {prefix}{rest!r}")


def plain_copy_of(model: torch.nn.Module, config: RunConfig, **fields) -> PlainLM:
    """A ``PlainLM`` holding exactly the weights of the Megatron ``model`` (same dtype);
    ``fields`` change the ``PlainConfig`` (e.g. ``attention_kernel="explicit"``)."""
    plain = PlainLM(dataclasses.replace(plain_config_for(config), **fields))
    dtype = next(model.parameters()).dtype
    plain.to(dtype)
    state = plain_state_from_megatron(dict(model.state_dict()), config)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise KeyError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    return plain
