"""The CQK causal language model for transformers (``trust_remote_code=True``).

Exported from cqk-megatron: numerically the Megatron ``GPTModel`` it came from (pre-norm
decoder; RoPE with Megatron's non-interleaved ``rotate_half`` convention, or learned
absolute positions; biases in the projections where the model has them).
The coupling and scoring classes are those ``cqk_variant.py`` beside this file names
(``config.coupling_class``, ``config.scoring_class``): from ``coupling.py``, a verbatim
copy of cqk-megatron's ``variants/plain_math.py``, or shipped in ``cqk_variant.py`` for a
variant registered outside it, so both frameworks run the same math. Imports only torch,
transformers and the files beside it.

Generation uses a ``DynamicCache``: a coupling acts per token and per head, so a token's
coupled (and rotated) key never changes once computed, and the cache holds coupled keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_cqk import CQKConfig
from .coupling import RMSNorm
from .cqk_variant import VARIANT_CLASSES

try:  # transformers >= 5: initialisers that skip weights already loaded from the checkpoint
    from transformers import initialization as init
except ImportError:  # pragma: no cover - older transformers initialise before loading
    from torch.nn import init

# transformers 5 renamed ``past_key_values`` to ``cache`` in model outputs
_CACHE_FIELD = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)


def _variant_class(name: str) -> type:
    """A class that ``cqk_variant.py`` names (``config.coupling_class``/``scoring_class``)."""
    if name not in VARIANT_CLASSES:
        raise ImportError(
            f"config.json names class {name!r}, which cqk_variant.py does not define (it "
            f"defines {sorted(VARIANT_CLASSES)}); was another exported folder of the same "
            "name loaded earlier in this process? transformers keeps the first one's "
            "cqk_variant.py: load this folder in a new process or under another name"
        )
    return VARIANT_CLASSES[name]


def _norm(config: CQKConfig) -> nn.Module:
    if config.normalization == "LayerNorm":
        return nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
    return RMSNorm(config.hidden_size, eps=config.norm_eps)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` of shape ``[b, s, 1, head_dim]``, computed as Megatron does (fp32)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / (base ** (exponent / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE on ``[b, s, heads, d]``: ``x cos + rotate_half(x) sin``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class CQKAttention(nn.Module):
    """Self-attention: projections, optional (q, k) coupling, RoPE, standard or
    differential scoring on ``scaled_dot_product_attention``."""

    def __init__(self, config: CQKConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.coupling_position = config.coupling_position
        hidden, d, bias = config.hidden_size, self.head_dim, config.linear_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=bias)
        self.coupling = None
        if config.coupling_class is not None:
            coupling = _variant_class(config.coupling_class)
            self.coupling = coupling(head_dim=d, **config.coupling_options)
        # A scoring's rule (differential: DifferentialScoring), called as rule(q, k, v,
        # attend). Its layer index is 0-based, as in the Megatron layer; its options are the
        # exporter's (differential: the paired form, each attention map once, two SDPA calls
        # with values 2 head_dim wide: SDPA's math path on CPU, a fused kernel on GPU).
        self.differential = None
        if config.scoring_class is not None:
            rule = _variant_class(config.scoring_class)
            self.differential = rule(
                d, layer_index=layer_idx, eps=config.norm_eps, **config.scoring_options
            )
        for module in (self.coupling, self.differential):
            if module is not None:  # these initialise themselves (identity maps, dt, lambda)
                for sub in module.modules():
                    sub._cqk_self_initialised = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
        is_causal: bool,
        cache=None,
    ) -> torch.Tensor:
        batch, seq, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, seq, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.coupling is not None and self.coupling_position == "pre_rope":
            q, k = self.coupling(q, k)
        if rotary is not None:  # None: learned absolute positions, added to the embeddings
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if self.coupling is not None and self.coupling_position == "post_rope":
            q, k = self.coupling(q, k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # SDPA layout [b, heads, s, d]
        if cache is not None:  # the cache keeps coupled, rotated keys
            k, v = cache.update(k, v, self.layer_idx)

        def attend(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q_,
                k_,
                v_,
                attn_mask=mask,
                is_causal=is_causal,
                scale=self.scale,
                enable_gqa=q_.shape[1] != k_.shape[1],
            )

        if self.differential is None:
            context = attend(q, k, v)
        else:
            context = self.differential(q, k, v, attend)
        context = context.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.o_proj(context)


class CQKMLP(nn.Module):
    def __init__(self, config: CQKConfig) -> None:
        super().__init__()
        hidden, ffn, bias = config.hidden_size, config.intermediate_size, config.linear_bias
        self.gated = config.mlp_activation == "swiglu"
        if self.gated:
            self.gate_proj = nn.Linear(hidden, ffn, bias=bias)
        self.up_proj = nn.Linear(hidden, ffn, bias=bias)
        self.down_proj = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class CQKDecoderLayer(nn.Module):
    def __init__(self, config: CQKConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = _norm(config)
        self.self_attn = CQKAttention(config, layer_idx)
        self.post_attention_layernorm = _norm(config)
        self.mlp = CQKMLP(config)

    def forward(self, hidden_states, rotary, mask, is_causal, cache=None) -> torch.Tensor:
        attended = self.self_attn(
            self.input_layernorm(hidden_states), rotary, mask, is_causal, cache
        )
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class CQKPreTrainedModel(PreTrainedModel):
    config_class = CQKConfig
    base_model_prefix = "model"
    _no_split_modules = ["CQKDecoderLayer"]
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        if getattr(module, "_cqk_self_initialised", False):
            return
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, (RMSNorm, nn.LayerNorm)):
            init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)


def _attention_mask(
    padding_mask: torch.Tensor | None, seq: int, past: int, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """SDPA's boolean mask ``[b, 1, seq, past + seq]`` (True = attend) and ``is_causal``.

    Without padding, SDPA's own causal path is used for a fresh sequence (as in the
    Megatron model) and no mask at all for one new token; otherwise the mask is explicit,
    since SDPA's ``is_causal`` aligns to the top-left corner and would ignore the cache.
    """
    total = past + seq
    if padding_mask is not None:
        if padding_mask.dim() != 2 or padding_mask.shape[-1] != total:
            raise ValueError(
                f"attention_mask must be [batch, {total}] (past + new tokens), got "
                f"{tuple(padding_mask.shape)}"
            )
        if bool(padding_mask.all()):
            padding_mask = None
    if padding_mask is None:
        if past == 0:
            return None, True
        if seq == 1:
            return None, False
    query_pos = torch.arange(past, total, device=device)[:, None]
    key_pos = torch.arange(total, device=device)[None, :]
    mask = (key_pos <= query_pos)[None, None]  # [1, 1, seq, total]
    if padding_mask is not None:
        mask = mask & padding_mask.bool()[:, None, None, :]
        # a padded query row would see no key at all (NaN in SDPA): let it see itself
        mask = mask | (key_pos == query_pos)[None, None]
    return mask, False


def _positions(
    padding_mask: torch.Tensor | None, batch: int, seq: int, past: int, device: torch.device
) -> torch.Tensor:
    """Token positions ``[b, seq]``; a left-padded row counts from its first real token
    (post-RoPE coupling is not shift-invariant, so padding must not move positions)."""
    if padding_mask is None or padding_mask.dim() != 2 or bool(padding_mask.all()):
        return torch.arange(past, past + seq, device=device).expand(batch, seq)
    counted = padding_mask.long().cumsum(-1) - 1
    return counted.clamp(min=0)[:, -seq:].to(device)


class CQKModel(CQKPreTrainedModel):
    def __init__(self, config: CQKConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = None
        if config.position_embedding_type == "learned_absolute":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(
            CQKDecoderLayer(config, index) for index in range(config.num_hidden_layers)
        )
        self.norm = _norm(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
    ) -> tuple[torch.Tensor, object]:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, seq = hidden.shape[:2]
        if use_cache and cache is None:
            cache = DynamicCache()
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = _positions(attention_mask, batch, seq, past, hidden.device)
        rotary = None
        if self.embed_positions is not None:
            hidden = hidden + self.embed_positions(position_ids)
        else:
            rotary = rotary_cos_sin(
                position_ids, self.config.head_dim, self.config.rotary_base, hidden.dtype
            )
        mask, is_causal = _attention_mask(attention_mask, seq, past, hidden.device)
        for layer in self.layers:
            hidden = layer(hidden, rotary, mask, is_causal, cache)
        return self.norm(hidden), cache


class CQKForCausalLM(CQKPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: CQKConfig) -> None:
        super().__init__(config)
        self.model = CQKModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        past_key_values=None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        cache = cache if cache is not None else past_key_values  # transformers 4 name
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        hidden, cache = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(),
                labels[:, 1:].flatten().to(logits.device),
                ignore_index=-100,
            )
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None}
        )
