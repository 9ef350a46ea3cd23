"""Self-attention whose (q, k) pass through a coupling before scoring.

``QKSelfAttention`` is Megatron's ``SelfAttention`` plus one optional submodule,
``coupling`` (any ``coupling.QKCoupling``). Before RoPE (the default) the coupling runs
on the tensors that ``get_query_key_value_tensors`` returns, so cached keys at inference
are coupled keys; after RoPE it runs in a pre-hook of the core attention, on the rotated
tensors. Without a coupling the module is exactly ``SelfAttention``.

How the coupling runs is ``fast_coupling.run_coupling``'s business: its fused form,
eagerly or through ``torch.compile`` (``coupling_impl``), optionally recomputed in the
backward (``recompute_coupling``). The parameters stay those of the ``plain_math.py``
module in ``self.coupling``, so checkpoints and exports do not depend on either choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from cqk_megatron.model.attention.fast_coupling import (
    RUN_IMPLS,
    has_fused_form,
    resolve_impl,
    run_coupling,
)
from cqk_megatron.model.attention.tp_grads import sum_partial_grads_across_tp
from cqk_megatron.parallel.device import device
from cqk_megatron.variants import COUPLING_POSITIONS


@dataclass
class QKSelfAttentionSubmodules(SelfAttentionSubmodules):
    coupling: ModuleSpec | type | None = None


class QKSelfAttention(SelfAttention):
    def __init__(
        self,
        config,
        submodules: QKSelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        coupling_position: str = "pre_rope",
        coupling_impl: str = "auto",
        recompute_coupling: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(config, submodules, layer_number, attn_mask_type, **kwargs)
        if coupling_position not in COUPLING_POSITIONS:
            raise ValueError(f"coupling_position must be one of {COUPLING_POSITIONS}")
        if coupling_impl not in ("auto", *RUN_IMPLS):
            raise ValueError(
                f"attention.coupling_impl={coupling_impl!r} is unknown; "
                f"choose one of {['auto', *RUN_IMPLS]}"
            )
        self.coupling_position = coupling_position
        self.recompute_coupling = recompute_coupling
        self.coupling = None
        if submodules.coupling is not None:
            self.coupling = build_module(
                submodules.coupling, head_dim=self.hidden_size_per_attention_head
            ).to(dtype=config.params_dtype)
        self.coupling_impl = coupling_impl = resolve_impl(
            coupling_impl, self.coupling, device().type
        )
        if self.coupling is not None:
            # f and dt are whole on every TP rank, each rank applies them to its heads
            sum_partial_grads_across_tp(self.coupling, self.tp_group)
            if coupling_impl == "compiled" and not has_fused_form(self.coupling):
                raise ValueError(
                    f"attention.coupling_impl=compiled: {type(self.coupling).__name__} has no "
                    "fused form registered (CouplingVariant.fused); use eager"
                )
            if coupling_position == "post_rope":
                self.core_attention.register_forward_pre_hook(self._couple_rotated_qk)

    def couple(self, query, key):
        return run_coupling(
            self.coupling, query, key, impl=self.coupling_impl, recompute=self.recompute_coupling
        )

    def _couple_rotated_qk(self, _module, args):
        query, key, *rest = args
        return (*self.couple(query, key), *rest)

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True
    ):
        outputs = super().get_query_key_value_tensors(
            hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv
        )
        if self.coupling is None or self.coupling_position != "pre_rope":
            return outputs
        if not split_qkv:
            raise NotImplementedError("QK coupling needs split q/k; disable fused_single_qkv_rope")
        query, key, *rest = outputs
        return (*self.couple(query, key), *rest)
