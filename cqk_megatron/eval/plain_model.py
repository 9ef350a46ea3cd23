"""A small decoder-only transformer in plain PyTorch, with its own coupled attention.

An implementation independent of this package's model: it imports nothing from
``cqk_megatron`` (not ``plain_math.py``, not Megatron) and writes every formula out. It
serves two purposes:

- the "independent implementation" of the MQAR investigation (``mqar_gap.py``), whose
  every architectural choice is a field of ``PlainConfig`` so that one difference at a time
  can be moved between it and the project's model;
- the reference the Megatron model is checked against on identical weights
  (``tests/test_plain_reference.py``): with ``PlainConfig.project(...)`` and weights copied
  from a Megatron ``GPTModel`` (``load_megatron_state``) it computes the same function.

Shapes are ``[batch, seq, ...]``. Couplings act per token and per head on ``(q, k)``
(``q``: ``[b, s, hq, d]``, ``k``: ``[b, s, hk, d]``; with grouped-query attention a query
reads its group's key and a key receives the mean over its group of what the queries send):

- ``hamiltonian`` (leapfrog): ``k += dt/2 f(q); q += dt k; k += dt/2 f(q)`` per step
- ``euler``: ``q, k = q + dt k, k + dt f(q)``
- ``mlp_only``: ``q, k = q + dt f_q(q), k + dt f_k(k)`` (``f_q``, ``f_k`` split ``f``'s width)
- ``invertible``: per layer ``q = q exp(s1(k)) + t1(k); k = k exp(s2(q)) + t2(q)``, log-scales
  bounded by ``bound * tanh(s / bound)``

Scoring is ``standard`` (softmax attention) or ``differential`` (Ye et al., 2024), written
out from the paper's formula: heads ``2i`` and ``2i+1`` give the two maps of differential
head ``i``, value heads ``2j`` and ``2j+1`` side by side its value of width ``2d``,
``(1 - lambda_init) RMSNorm((A1 - lambda A2) v)`` its output, with
``lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init`` and
``lambda_init = 0.8 - 0.6 exp(-0.3 l)`` at 0-based depth ``l``. ``differential_norm``
changes the output: ``none`` is ``(A1 - lambda A2) v`` as it is, ``small_start`` the
paper's norm with its weight starting at 0.1 instead of 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")
# The couplings written out below, under the registry's names (``cqk_megatron.variants``;
# not imported: this model is independent by design). tests/test_plain_reference.py checks
# each one against the Megatron model and that every registered coupling is here.
COUPLINGS = ("none", "hamiltonian", "euler", "mlp_only", "invertible")
SCORINGS = ("standard", "differential")
# What follows (A1 - lambda A2) v: the paper's (1 - lambda_init) RMSNorm, nothing, or the
# paper's norm with its weight starting at SMALL_START (the registry's attention.differential_norm)
DIFFERENTIAL_NORMS = ("paper", "none", "small_start")
SMALL_START = 0.1
DT_PARAMS = ("exp", "softplus")
INITS = ("torch", "gpt2")


# The project's Llama-style architecture and law of initial weights, as PlainConfig fields
# (PlainConfig.project(); the MQAR gap study starts its rungs from them).
PROJECT_FIELDS = dict(
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
    positions="rope",
    f_output_bias=False,
    dt_param="softplus",
    init="gpt2",
)


@dataclass(frozen=True)
class PlainConfig:
    """Every choice of the model; the defaults are the independent MQAR model of the gap
    study (``cqk mqar gap``)."""

    vocab_size: int = 512
    hidden: int = 64
    layers: int = 2
    heads: int = 1
    kv_heads: int | None = None  # None: as many as heads
    seq_len: int = 128
    ffn: int | None = None  # None: 4 * hidden (gelu) or 64 * ceil(8/3 hidden / 64) (swiglu)
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    mlp: str = "gelu"
    bias: bool = True  # biases in the attention and MLP projections
    positions: str = "learned"
    rotary_base: float = 10000.0
    tie_embeddings: bool = False
    init: str = "torch"  # torch: PyTorch's module defaults; gpt2: N(0, 0.02), zero biases
    # coupling
    coupling: str = "hamiltonian"
    coupling_position: str = "pre_rope"  # pre_rope | post_rope (only with rope)
    steps: int = 1
    f_hidden: int | None = None  # None: head_dim
    f_output_bias: bool = True
    dt_param: str = "exp"  # exp: dt = exp(log_dt) | softplus: dt = softplus(raw)
    dt_init: float = 0.1
    invertible_layers: int = 2
    invertible_bound: float = 2.0
    # sdpa: torch's fused kernel (fast); explicit: softmax(q k^T / sqrt(d)) written out
    attention_kernel: str = "sdpa"
    scoring: str = "standard"  # standard | differential (maps always written out)
    lambda_std: float = 0.1  # differential: lambda vectors start N(0, lambda_std)
    differential_norm: str = "paper"  # paper | none | small_start (DIFFERENTIAL_NORMS)
    # differential: lambda_init in every layer; None: the paper's 0.8 - 0.6 exp(-0.3 l)
    differential_lambda_init: float | None = None

    def __post_init__(self) -> None:
        for name, allowed in (
            ("norm", NORMS),
            ("mlp", MLPS),
            ("positions", POSITIONS),
            ("coupling", COUPLINGS),
            ("dt_param", DT_PARAMS),
            ("init", INITS),
            ("coupling_position", ("pre_rope", "post_rope")),
            ("attention_kernel", ("sdpa", "explicit")),
            ("scoring", SCORINGS),
            ("differential_norm", DIFFERENTIAL_NORMS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"PlainConfig.{name}={getattr(self, name)!r}; one of {allowed}")
        if self.hidden % self.heads or self.heads % self.num_kv_heads:
            raise ValueError("PlainConfig: hidden % heads and heads % kv_heads must be 0")
        if self.scoring == "differential" and self.num_kv_heads % 2:
            raise ValueError("PlainConfig: differential scoring pairs heads; kv_heads must be even")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn_size(self) -> int:
        if self.ffn is not None:
            return self.ffn
        if self.mlp == "gelu":
            return 4 * self.hidden
        return 64 * math.ceil(8 * self.hidden / 3 / 64)

    @classmethod
    def project(cls, **fields) -> PlainConfig:
        """The project's Llama-style model (RMSNorm, SwiGLU, RoPE, no biases, ``f`` without
        an output bias, ``dt = softplus(raw)``); ``fields`` override."""
        return replace(cls(**PROJECT_FIELDS), **fields)


class PlainRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        # device=None: the default device (mqar_train builds the model under device())
        self.weight = nn.Parameter(torch.ones(dim, device=None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TwoLayer(nn.Module):
    """``fc2(silu(fc1(x)))``: the coupling's ``f``."""

    def __init__(self, dim: int, hidden: int, out: int, output_bias: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, out, bias=output_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(x)))


class PlainCoupling(nn.Module):
    """The (q, k) couplings, written out from their formulas."""

    def __init__(self, config: PlainConfig) -> None:
        super().__init__()
        self.kind, self.steps = config.coupling, config.steps
        d = config.head_dim
        hidden = config.f_hidden or d
        if self.kind == "invertible":
            self.bound = config.invertible_bound
            self.q_nets = nn.ModuleList(
                TwoLayer(d, hidden, 2 * d, True) for _ in range(config.invertible_layers)
            )
            self.k_nets = nn.ModuleList(
                TwoLayer(d, hidden, 2 * d, True) for _ in range(config.invertible_layers)
            )
            for net in (*self.q_nets, *self.k_nets):  # identity at initialisation
                nn.init.zeros_(net.fc2.weight)
                nn.init.zeros_(net.fc2.bias)
            return
        if self.kind == "mlp_only":
            self.f_q = TwoLayer(d, hidden // 2, d, config.f_output_bias)
            self.f_k = TwoLayer(d, hidden - hidden // 2, d, config.f_output_bias)
        else:
            self.f = TwoLayer(d, hidden, d, config.f_output_bias)
        self.dt_param = config.dt_param
        init = config.dt_init
        raw = math.log(init) if self.dt_param == "exp" else math.log(math.expm1(init))
        self.dt_raw = nn.Parameter(torch.tensor([raw], device=None))  # the default device

    def dt(self) -> torch.Tensor:
        return torch.exp(self.dt_raw) if self.dt_param == "exp" else F.softplus(self.dt_raw)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        group = q.shape[-2] // k.shape[-2]

        def to_q(x):  # a key head for each query head of its group
            return x.repeat_interleave(group, dim=-2)

        def to_k(x):  # the mean over each query group
            return x.unflatten(-2, (k.shape[-2], group)).mean(-2)

        if self.kind == "invertible":
            for q_net, k_net in zip(self.q_nets, self.k_nets, strict=True):
                s1, t1 = q_net(to_q(k)).chunk(2, dim=-1)
                q = q * torch.exp(self.bound * torch.tanh(s1 / self.bound)) + t1
                s2, t2 = k_net(q).chunk(2, dim=-1)
                s2 = to_k(self.bound * torch.tanh(s2 / self.bound))
                k = k * torch.exp(s2) + to_k(t2)
            return q, k
        dt = self.dt()
        for _ in range(self.steps):
            if self.kind == "hamiltonian":
                k = k + dt / 2 * to_k(self.f(q))
                q = q + dt * to_q(k)
                k = k + dt / 2 * to_k(self.f(q))
            elif self.kind == "euler":
                q, k = q + dt * to_q(k), k + dt * to_k(self.f(q))
            else:  # mlp_only
                q, k = q + dt * self.f_q(q), k + dt * self.f_k(k)
        return q, k


def rotate(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE on ``[b, s, heads, d]``, halves not interleaved: ``x cos + rotate_half(x) sin``.

    The angle table is fp32 whatever ``x`` is, as in Megatron (and the HF export).
    """
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [b, s, d/2]
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class PlainDifferential(nn.Module):
    """Differential Attention's scoring for one layer, from the paper's formula."""

    def __init__(self, config: PlainConfig, layer_index: int) -> None:
        super().__init__()
        d = config.head_dim
        self.lambda_init = config.differential_lambda_init
        if self.lambda_init is None:
            self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_index)
        self.scale = 1 / math.sqrt(d)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            vector = torch.empty(d, device=None).normal_(0, config.lambda_std)
            setattr(self, name, nn.Parameter(vector))
        self.norm = config.differential_norm
        self.subln = None if self.norm == "none" else PlainRMSNorm(2 * d, config.norm_eps)
        if self.norm == "small_start":
            nn.init.constant_(self.subln.weight, SMALL_START)

    def lam(self) -> torch.Tensor:
        first = torch.exp((self.lambda_q1 * self.lambda_k1).sum())
        return first - torch.exp((self.lambda_q2 * self.lambda_k2).sum()) + self.lambda_init

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q``: ``[b, s, H, d]``; ``k``, ``v``: ``[b, s, Hk, d]`` -> ``[b, s, H d]``."""
        b, s, heads, d = q.shape
        group = heads // k.shape[2]  # query heads per key head: pairs share it too
        q = q.view(b, s, heads // 2, 2, d).permute(0, 2, 3, 1, 4)  # [b, H/2, 2, s, d]
        k = k.view(b, s, k.shape[2] // 2, 2, d).permute(0, 2, 3, 1, 4)
        v = v.reshape(b, s, v.shape[2] // 2, 2 * d).transpose(1, 2)  # [b, Hk/2, s, 2d]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-1, -2) * self.scale  # [b, H/2, 2, s, s]
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        maps = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out = (maps[:, :, 0] - self.lam() * maps[:, :, 1]) @ v  # [b, H/2, s, 2d]
        if self.subln is not None:  # differential_norm paper or small_start
            out = self.subln(out) * (1 - self.lambda_init)
        return out.transpose(1, 2).reshape(b, s, heads * d)


class PlainAttention(nn.Module):
    def __init__(self, config: PlainConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.config = config
        d, hq, hk = config.head_dim, config.heads, config.num_kv_heads
        self.q = nn.Linear(config.hidden, hq * d, bias=config.bias)
        self.k = nn.Linear(config.hidden, hk * d, bias=config.bias)
        self.v = nn.Linear(config.hidden, hk * d, bias=config.bias)
        self.o = nn.Linear(hq * d, config.hidden, bias=config.bias)
        self.coupling = PlainCoupling(config) if config.coupling != "none" else None
        self.differential = (
            PlainDifferential(config, layer_index) if config.scoring == "differential" else None
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, s, _ = x.shape
        q = self.q(x).view(b, s, c.heads, c.head_dim)
        k = self.k(x).view(b, s, c.num_kv_heads, c.head_dim)
        v = self.v(x).view(b, s, c.num_kv_heads, c.head_dim)
        couple_after_rope = c.coupling_position == "post_rope" and c.positions == "rope"
        if self.coupling is not None and not couple_after_rope:
            q, k = self.coupling(q, k)
        if c.positions == "rope":
            q, k = rotate(q, positions, c.rotary_base), rotate(k, positions, c.rotary_base)
        if self.coupling is not None and couple_after_rope:
            q, k = self.coupling(q, k)
        if self.differential is not None:
            return self.o(self.differential(q, k, v))
        group = c.heads // c.num_kv_heads
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
        if c.attention_kernel == "sdpa":
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(c.head_dim)
            future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            context = scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v
        context = context.transpose(1, 2).reshape(b, s, c.heads * c.head_dim)
        return self.o(context)


class PlainMLP(nn.Module):
    def __init__(self, config: PlainConfig) -> None:
        super().__init__()
        self.gated = config.mlp == "swiglu"
        ffn = config.ffn_size
        if self.gated:
            self.gate = nn.Linear(config.hidden, ffn, bias=config.bias)
        self.up = nn.Linear(config.hidden, ffn, bias=config.bias)
        self.down = nn.Linear(ffn, config.hidden, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


def _norm(config: PlainConfig) -> nn.Module:
    if config.norm == "layernorm":
        return nn.LayerNorm(config.hidden, eps=config.norm_eps)
    return PlainRMSNorm(config.hidden, config.norm_eps)


class PlainBlock(nn.Module):
    def __init__(self, config: PlainConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.norm1, self.attn = _norm(config), PlainAttention(config, layer_index)
        self.norm2, self.mlp = _norm(config), PlainMLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), positions)
        return x + self.mlp(self.norm2(x))


class PlainLM(nn.Module):
    """Pre-norm decoder: embeddings (+ learned positions), blocks, final norm, head."""

    def __init__(self, config: PlainConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden)
        self.pos_emb = (
            nn.Embedding(config.seq_len, config.hidden) if config.positions == "learned" else None
        )
        self.blocks = nn.ModuleList(PlainBlock(config, index) for index in range(config.layers))
        self.final_norm = _norm(config)
        self.head = (
            None
            if config.tie_embeddings
            else nn.Linear(config.hidden, config.vocab_size, bias=False)
        )
        if config.init == "gpt2":
            self._gpt2_init()

    @torch.no_grad()
    def _gpt2_init(self) -> None:
        """GPT-2's (and Megatron's) scheme: N(0, 0.02) weights, zero biases, and the two
        projections into the residual stream at 0.02 / sqrt(2 layers). The coupling keeps
        PyTorch's defaults, as the project's ``plain_math.py`` does, and the differential
        scoring its own (lambda vectors N(0, lambda_std), sub-layer norm ones)."""
        std = 0.02
        coupling = {
            id(p) for b in self.blocks if b.attn.coupling for p in b.attn.coupling.parameters()
        }
        coupling |= {
            id(p)
            for b in self.blocks
            if b.attn.differential
            for p in b.attn.differential.parameters()
        }
        residual = {id(b.attn.o.weight) for b in self.blocks} | {
            id(b.mlp.down.weight) for b in self.blocks
        }
        for name, param in self.named_parameters():
            if id(param) in coupling or "norm" in name:  # norms keep ones and zeros
                continue
            if name.endswith(".bias"):
                param.zero_()
            elif id(param) in residual:
                param.normal_(0, std / math.sqrt(2 * self.config.layers))
            else:
                param.normal_(0, std)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.tok_emb(tokens)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x, positions)
        return self.final_norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.tok_emb.weight if self.head is None else self.head.weight
        return hidden @ weight.t()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits(self.hidden_states(tokens))

    def coupling_parameters(self) -> list[nn.Parameter]:
        return [p for b in self.blocks if b.attn.coupling for p in b.attn.coupling.parameters()]

    def dt_parameters(self) -> list[nn.Parameter]:
        return [b.attn.coupling.dt_raw for b in self.blocks if hasattr(b.attn.coupling, "dt_raw")]
