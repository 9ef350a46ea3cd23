"""Differential Attention (Ye et al., 2024) as a Megatron core attention.

Only the scoring changes: the projections keep the baseline's shapes, heads pair up
inside each tensor-parallel rank (so heads per rank must be even), and the math is
``coupling.DifferentialScoring``, shared with the exported Hugging Face model.

Each differential head needs two attention maps applied to a value of width
``2 head_dim``. The ``paired`` form computes each map once (two calls with the wide
value); the ``split`` form computes each map twice (four calls, one per ``head_dim``
half of the value), for kernels that take only values as wide as queries. Which
kernels take which widths (PyTorch source, ``aten/src/ATen/native/transformers/``):

- CPU flash: ``sdp_utils_cpp.cpp`` ``check_head_dim_size_cpp`` requires q, k and v of the
  same last dimension; anything else runs the math path, which materialises every full
  ``s x s`` map (measured: slightly faster than four flash calls at 256 tokens, 1.5x slower
  at 1024).
- CUDA flash (FlashAttention-2, and FA3 where enabled: the same gate):
  ``cuda/sdp_utils.cpp`` ``check_head_dim_size_flash`` ("All head_dim sizes must be equal
  and less than 256").
- CUDA memory-efficient: ``check_head_dim_size_mem_efficient`` requires only
  ``q.size(-1) == k.size(-1)`` and alignment of both widths: it takes ``2 head_dim``
  values, but is the slower kernel ("flash_attention V2 is universally faster than
  efficient_attention and Math", the comment over ``priority_order`` in the same file).
- cuDNN: ``check_cudnn_tensor_shapes`` bounds ``d_qk`` and ``d_v`` separately (128; 256 on
  sm90/sm100 with cuDNN > 9.22 and a frontend >= 1.24) and ``check_cudnn_d256_bprop_head_dim``
  allows a backward for ``d_qk, d_v <= 128``, ``(192, 128)`` or ``(256, 256)``: with
  ``head_dim <= 64`` the paired form's ``(d, 2d)`` runs forward and backward on cuDNN.
- Transformer Engine: ``DotProductAttention(kv_channels=(k_channels, v_channels))``, as
  Megatron-Core's multi-latent attention builds it.

On CPU, where no SDPA kernel but the math path takes the wide value, the paired form
runs ``paired_maps`` (causal, no dropout): both maps of a differential head are
materialised block by block of query rows, so the key blocks wholly in a query block's
future are never computed (as flash skips them), and combined, ``A1 - lambda A2``, before
one product with the wide value. It is the same function as the reference's two calls.

``attention.differential_kernel=auto`` takes ``paired`` where a fast kernel serves the
wide value: with Transformer Engine on GPU; on GPU where SDPA's own dispatcher
(``torch._fused_sdp_choice``, the gate ``scaled_dot_product_attention`` goes through)
picks flash or cuDNN for it; on CPU where ``paired_maps`` applies (measured faster than
four flash calls: README, Performance). Otherwise ``split``: flash for four narrow calls
beats the memory-efficient or math kernel for two wide ones. The choice is made once per
layer at build and printed once per process on rank 0.

Megatron's layers run the reference forms' attention calls and the reference's
``out1 - lambda out2`` unchanged, and its RMSNorm and ``(1 - lambda_init)`` as one fused
``F.rms_norm`` with the weight scaled instead of the output: one kernel instead of six
elementwise passes over the output, forward and backward, for the same function.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from torch.autograd.function import once_differentiable

from cqk_megatron.model.attention.sdpa import SDPACoreAttention, chosen_sdpa_kernel
from cqk_megatron.model.attention.tp_grads import sum_partial_grads_across_tp
from cqk_megatron.variants import DIFFERENTIAL_KERNEL_SETTINGS
from cqk_megatron.variants.plain_math import DifferentialScoring, pair_values

KERNEL_SETTINGS = DIFFERENTIAL_KERNEL_SETTINGS  # attention.differential_kernel: auto or a form
FAST_WIDE_VALUE_KERNELS = ("flash", "cudnn")  # SDPA kernels for which auto pairs
PROBE_SEQ = 128  # probe length: past every kernel's minimum, a multiple of 64
MAPS_BLOCK = 128  # query rows per block of paired_maps (fastest of 64..256 measured on CPU)


class _PairedMaps(torch.autograd.Function):
    """Block-causal ``(A1 - lam A2) v`` with a written-out backward.

    ``Q``, ``K``: ``[B, 2, s, d]`` (the two maps of each of ``B`` differential heads),
    ``V``: ``[B, s, 2d]``. Per block of query rows the forward keeps the two softmax maps
    and their combination; the backward runs the matmuls and one fused softmax backward per
    block, and accumulates ``dK``, ``dV`` in place. Autograd of the same ops would also
    mask the gradient (a masked probability is 0 already), gather the blocks' slices into
    zero tensors and multiply twice for ``lam``: 13% (256 tokens) to 20% (1024) slower.
    """

    @staticmethod
    def forward(ctx, Q, K, V, lam, scale: float, block: int):
        seq = Q.shape[2]
        queries = Q * scale
        outputs, saved, start = [], [], 0
        for rows in queries.split(block, dim=2):
            end = start + rows.shape[2]
            keys = K if end == seq else K[:, :, :end]
            scores = torch.matmul(rows, keys.transpose(-1, -2))  # [B, 2, rows, end]
            future = torch.ones(end - start, end, dtype=torch.bool, device=Q.device)
            probs = torch.softmax(scores.masked_fill_(future.triu(start + 1), -math.inf), -1)
            maps = torch.addcmul(probs[:, 0], probs[:, 1], -lam)  # A1 - lam A2
            outputs.append(torch.matmul(maps, V if end == seq else V[:, :end]))
            saved += [probs, maps]
            start = end
        ctx.scale, ctx.block = scale, block
        ctx.save_for_backward(queries, K, V, lam, *saved)
        return torch.cat(outputs, dim=1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        queries, K, V, lam, *saved = ctx.saved_tensors
        seq = queries.shape[2]
        dQ, dK, dV = torch.empty_like(queries), torch.zeros_like(K), torch.zeros_like(V)
        dlam = torch.zeros_like(lam)
        weights = torch.stack((torch.ones_like(lam), -lam)).view(1, 2, 1, 1)  # dA1, dA2
        for index, start in enumerate(range(0, seq, ctx.block)):
            end = min(start + ctx.block, seq)
            probs, maps = saved[2 * index], saved[2 * index + 1]
            g = grad[:, start:end]  # [B, rows, 2d]
            d_maps = torch.matmul(g, (V if end == seq else V[:, :end]).transpose(-1, -2))
            dV[:, :end].baddbmm_(maps.transpose(-1, -2), g)
            dlam -= (d_maps * probs[:, 1]).sum()
            d_scores = torch._softmax_backward_data(
                d_maps.unsqueeze(1) * weights, probs, -1, probs.dtype
            )  # [B, 2, rows, end]; 0 where masked, as the probabilities are
            dQ[:, :, start:end] = torch.matmul(d_scores, K if end == seq else K[:, :, :end])
            dK[:, :, :end] += torch.matmul(d_scores.transpose(-1, -2), queries[:, :, start:end])
        return dQ.mul_(ctx.scale), dK, dV, dlam, None, None


def paired_maps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    scale: float,
    block: int = MAPS_BLOCK,
) -> torch.Tensor:
    """Causal ``(A1 - lam A2) v`` of every differential head, maps computed once.

    SDPA layout: ``q`` ``[b, H, s, d]``, ``k``, ``v`` ``[b, Hk, s, d]``; returns
    ``[b, H/2, s, 2d]``, ``DifferentialScoring``'s ``out1 - lam out2``. Differential query
    head ``i`` reads key/value pair ``i // (H / Hk)`` (repeated for its group, autograd
    summing the group's gradients). Query rows go in blocks; a block reads only the keys
    up to its last row.
    """
    batch, pairs, kv_pairs = q.shape[0], q.shape[1] // 2, k.shape[1] // 2
    keys, value = k.unflatten(1, (kv_pairs, 2)), pair_values(v)  # [b, Pk, 2, s, d], 2d
    if pairs != kv_pairs:
        keys = keys.repeat_interleave(pairs // kv_pairs, dim=1)
        value = value.repeat_interleave(pairs // kv_pairs, dim=1)
    out = _PairedMaps.apply(
        q.unflatten(1, (pairs, 2)).flatten(0, 1),
        keys.flatten(0, 1),
        value.flatten(0, 1),
        lam.type_as(q),
        scale,
        block,
    )
    return out.unflatten(0, (batch, pairs))


def fused_normalize(scoring: DifferentialScoring, diff: torch.Tensor) -> torch.Tensor:
    """``scoring.normalize(diff)`` as one ``F.rms_norm`` with ``(1 - lambda_init)`` folded
    into the weight (a ``2 head_dim`` vector) instead of multiplying the output; ``diff``
    itself where the scoring has no norm (``attention.differential_norm=none``)."""
    if scoring.subln is None:
        return diff
    weight = scoring.subln.weight * (1 - scoring.lambda_init)
    return F.rms_norm(diff, (diff.shape[-1],), weight.to(diff.dtype), scoring.subln.eps)


def choose_kernel(
    setting: str,
    transformer_impl: str,
    device: torch.device,
    wide_value_kernel: Callable[[], str],
    cpu_maps: bool = True,
) -> tuple[str, str]:
    """``(kernel, reason)`` for ``attention.differential_kernel=setting``.

    ``wide_value_kernel()`` names the SDPA kernel that would serve the paired form's
    calls (queries ``head_dim``, values ``2 head_dim``); it is asked only under ``auto``.
    ``cpu_maps``: whether ``paired_maps`` would run the paired form on CPU (causal
    attention without dropout).
    """
    if setting not in KERNEL_SETTINGS:
        raise ValueError(
            f"attention.differential_kernel={setting!r} is unknown; choose one of "
            f"{list(KERNEL_SETTINGS)}"
        )
    if setting != "auto":
        return setting, "attention.differential_kernel"
    if transformer_impl == "transformer_engine" and device.type == "cuda":
        return "paired", "Transformer Engine DotProductAttention, k_channels != v_channels"
    if device.type == "cpu" and cpu_maps:
        return "paired", "block-causal maps on CPU"
    served_by = wide_value_kernel()
    if served_by in FAST_WIDE_VALUE_KERNELS:
        return "paired", f"SDPA serves 2x-wide values with {served_by}"
    return "split", f"SDPA would serve 2x-wide values with {served_by}, not flash or cuDNN"


_REPORTED: set[str] = set()


def report_kernel(kernel: str, reason: str) -> None:
    """One line per process (rank 0) for each distinct choice: which form this run uses."""
    line = f"differential attention: {kernel} form ({reason})"
    if line in _REPORTED:
        return
    _REPORTED.add(line)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


def _te_paired_attention(config, layer_number, attn_mask_type, softmax_scale, pg_collection):
    """Transformer Engine's attention for the paired calls: ``H/2`` query heads and
    ``Hk/2`` key/value heads (global counts; TE divides by TP), ``k_channels = d`` and
    ``v_channels = 2d``, as Megatron-Core's MLA builds its ``TEDotProductAttention``.

    Not run in CI (no GPU, no TE): a small branch kept apart for review.
    """
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.utils import is_te_min_version

    if not is_te_min_version("1.10.0"):  # Megatron passes (k, v) channels from TE 1.10 on
        raise RuntimeError(
            "attention.differential_kernel=paired with transformer_impl=transformer_engine needs "
            "Transformer Engine >= 1.10 (values wider than queries); upgrade it or set "
            "attention.differential_kernel=split"
        )
    pairs = copy.copy(config)  # TE reads head counts from the config; the copy skips checks
    pairs.num_attention_heads = config.num_attention_heads // 2
    pairs.num_query_groups = config.num_query_groups // 2
    return TEDotProductAttention(
        pairs,
        layer_number,
        attn_mask_type,
        attention_type="self",
        softmax_scale=softmax_scale,
        k_channels=config.kv_channels,
        v_channels=2 * config.kv_channels,
        pg_collection=pg_collection,
    )


class DifferentialCoreAttention(SDPACoreAttention):
    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        *args,
        differential_kernel: str = "auto",
        differential_norm: str = "paper",
        differential_lambda_init: float | None = None,
        transformer_impl: str = "local",
        reference: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        # paired_maps runs the paired form: CPU, causal, no dropout
        self.maps = device.type == "cpu" and attn_mask_type == AttnMaskType.causal
        self.maps = self.maps and self.dropout_p == 0.0
        self.kernel, reason = choose_kernel(
            differential_kernel,
            transformer_impl,
            device,
            lambda: self.wide_value_kernel(device),
            cpu_maps=self.maps,
        )
        report_kernel(self.kernel, reason)
        self.differential = DifferentialScoring(
            self.head_dim,
            layer_index=self.layer_number - 1,
            eps=config.layernorm_epsilon,
            kernel=self.kernel,
            norm=differential_norm,
            lambda_init=differential_lambda_init,
        ).to(dtype=config.params_dtype)
        # lambda and subln are whole on every TP rank but each rank uses them on its heads
        sum_partial_grads_across_tp(self.differential, self.tp_group)
        self.reference = reference  # run plain_math.py's module as it is (benchmarks)
        self.last_path: str | None = None  # what the last forward ran: te, maps or sdpa
        self.te_attention = None
        te_paired = transformer_impl == "transformer_engine" and self.kernel == "paired"
        if te_paired and device.type == "cuda":
            self.te_attention = _te_paired_attention(
                config,
                layer_number,
                attn_mask_type,
                self.softmax_scale,
                kwargs.get("pg_collection"),
            )

    @classmethod
    def spec_params(cls, attention, transformer_impl: str) -> dict:
        return {
            "differential_kernel": attention.differential_kernel,
            "differential_norm": attention.differential_norm,
            "differential_lambda_init": attention.differential_lambda_init,
            "transformer_impl": transformer_impl,
            # cqk bench's @reference (set past validation): plain_math.py's modules as they are
            "reference": attention.coupling_impl == "reference",
        }

    def wide_value_kernel(self, device: torch.device) -> str:
        """The SDPA kernel for one paired call of this layer (per-rank heads, training)."""
        tp = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        pairs = self.config.num_attention_heads // tp // 2
        kv_pairs = self.config.num_query_groups // tp // 2
        d, dtype = self.head_dim, self.config.params_dtype

        def probe(heads: int, width: int) -> torch.Tensor:
            shape = (1, heads, PROBE_SEQ, width)
            return torch.zeros(shape, device=device, dtype=dtype, requires_grad=True)

        mask = None
        if self.attn_mask_type != AttnMaskType.causal:
            mask = torch.ones(PROBE_SEQ, PROBE_SEQ, device=device, dtype=torch.bool)
        return chosen_sdpa_kernel(
            probe(pairs, d),
            probe(kv_pairs, d),
            probe(kv_pairs, 2 * d),
            mask=mask,
            dropout_p=self.dropout_p,
            scale=self.softmax_scale,
        )

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if self.te_attention is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("packed sequences and attention bias are not supported")
        self.last_path = "te"
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        mask_type = attn_mask_type or self.attn_mask_type

        def attend_te(q_, k_, v_):  # SDPA's [b, heads, s, d] in and out, TE's sbhd in between
            sbhd = [x.permute(2, 0, 1, 3).contiguous() for x in (q_, k_, v_)]
            out = self.te_attention(*sbhd, attention_mask, attn_mask_type=mask_type)
            seq, batch = out.shape[:2]
            return out.view(seq, batch, q_.shape[1], v_.shape[-1]).permute(1, 2, 0, 3)

        context = self.combine(*self.differential.attend_maps(q, k, v, attend_te))
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def score(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        scoring = self.differential
        if self.reference:
            self.last_path = "sdpa"
            return scoring(q, k, v, lambda q_, k_, v_: self.attend(q_, k_, v_, mask))
        if self.kernel == "paired" and self.maps and mask is None and q.device.type == "cpu":
            self.last_path = "maps"
            lam = scoring.lambda_full()
            return fused_normalize(scoring, paired_maps(q, k, v, lam, self.softmax_scale))
        self.last_path = "sdpa"
        outputs = scoring.attend_maps(q, k, v, lambda q_, k_, v_: self.attend(q_, k_, v_, mask))
        return self.combine(*outputs)

    def combine(self, out1: torch.Tensor, out2: torch.Tensor) -> torch.Tensor:
        """The reference's ``combine``, its normalisation fused."""
        diff = out1 - self.differential.lambda_full().type_as(out1) * out2
        return fused_normalize(self.differential, diff)
