"""One run of the README's MQAR benchmark setup with one thing changed: a probe.

    cqk mqar probe standard --family gpt2 --seed 0 --steps 2000
    cqk mqar probe standard --family gpt2 \\
        --megatron model.family=null model.normalization=LayerNorm model.swiglu=false \\
            model.position_embedding_type=learned_absolute model.add_bias_linear=true \\
            model.swiglu=true                       # GPT-2 with SwiGLU instead of GELU
    cqk mqar probe invertible_differential --freeze-coupling

The run is ``mqar.BENCHMARK``'s options on 64x4 (or ``--setting``) with the given
changes: ``--megatron`` RunConfig overrides after the family's (``model.family=null``
leaves the fields alone to decide, so the GPT-2 family minus one field is written out as
above), ``--steps`` / ``--lr`` / ``--eval-every``, and ``--freeze-coupling``, which
trains everything but the coupling's parameters (the invertible coupling then stays the
identity it starts as). It prints the held-out curve as one line; nothing is written.
Used for the README's look at why the GPT-2 family and invertible_differential stay at
0.26 on 64x4 (MQAR section).
"""

from __future__ import annotations

import torch

from cqk_megatron.eval import mqar_train
from cqk_megatron.eval.mqar import BENCHMARK
from cqk_megatron.eval.mqar_data import MQARSetting


def freeze_coupling(model: torch.nn.Module) -> int:
    """Stop the coupling's parameters from training (no gradient: AdamW and clipping skip
    them); how many there are. A model without a coupling is refused."""
    coupling = [p for name, p in model.named_parameters() if ".coupling." in name]
    if not coupling:
        raise ValueError("--freeze-coupling: this variant has no coupling parameters")
    for param in coupling:
        param.requires_grad_(False)
    return len(coupling)


def probe(
    variant: str,
    setting: MQARSetting,
    changes: dict,
    freeze: bool = False,
) -> dict:
    """``train_run`` with the benchmark's options and ``changes``; the coupling's
    parameters frozen if ``freeze``."""
    options = mqar_train.TrainOptions(**{**BENCHMARK["options"], **changes})
    if not freeze:
        return mqar_train.train_run(variant, setting, options)
    build = mqar_train.build

    def frozen(*args, **kwargs):
        model = build(*args, **kwargs)
        freeze_coupling(model)
        return model

    mqar_train.build = frozen  # train_run builds through the module's name
    try:
        return mqar_train.train_run(variant, setting, options)
    finally:
        mqar_train.build = build
