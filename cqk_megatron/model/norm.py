"""The layer norms of the local spec: PyTorch's RMSNorm / LayerNorm, under sequence
parallelism too.

Megatron-Core's ``WrappedTorchNorm`` (what its local spec uses without Apex) asserts "sequence
parallel not supported by torch LayerNorm", so without Apex or Transformer Engine a
``parallel.sequence_parallel=true`` run could not start. The norm itself needs nothing
from sequence parallelism (it works token by token); what changes is its gradient: each
tensor-parallel rank sees its own slice of the sequence, so the gradient of the replicated
weight (and bias) is a partial sum, to be added up across the tensor-parallel group.

That sum is the tensor hook of ``attention/tp_grads.py``, the one that serves ``f``, ``dt``
and ``lambda``: it runs as soon as autograd has the gradient, before DeepSpeed or
Megatron's gradient buffers see it, so both engines get the TP=1 gradient (DeepSpeed's
engine under ZeRO-1 takes the hook over and sums once per step: ``tp_grads``). The parameters
are deliberately *not* marked ``sequence_parallel``: Megatron's ``finalize_model_grads``
(``train.engine=megatron``) all-reduces the gradients of parameters so marked, which would
add the partial sums a second time.

Parameter names and shapes are those of ``WrappedTorchNorm`` (it returns the torch module
itself), so checkpoints and exports are unchanged.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from cqk_megatron.model.attention.tp_grads import sum_partial_grads_across_tp

NORMS: dict[str, type[torch.nn.Module]] = {
    "RMSNorm": torch.nn.RMSNorm,
    "LayerNorm": torch.nn.LayerNorm,
}


class TorchNorm:
    """``WrappedTorchNorm``'s constructor (what Megatron's specs call), returning the torch
    norm named by ``config.normalization``, with its gradients summed across the
    tensor-parallel group under sequence parallelism."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError(
                "zero-centred gamma and memory-efficient layer norm need "
                "transformer_impl=transformer_engine"
            )
        if config.normalization not in NORMS:
            raise ValueError(
                f"model.normalization={config.normalization!r}; choose one of {list(NORMS)}"
            )
        norm = NORMS[config.normalization](hidden_size, eps=eps)
        if config.sequence_parallel:
            sum_partial_grads_across_tp(norm, parallel_state.get_tensor_model_parallel_group())
        return norm
