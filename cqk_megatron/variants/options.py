"""Choices and bounds of the attention options, for the config checks and the layers alike.

Torch-free, like the rest of the registry: ``config.validate`` reads them, and so do the
attention layers that implement them. The bounds the math itself enforces are read from
``plain_math.py`` (``math_constant``), where they live.
"""

from __future__ import annotations

from cqk_megatron.variants.registry import math_constant

COUPLING_POSITIONS = ("pre_rope", "post_rope")  # attention.position (attention/coupled.py)
# attention.coupling_impl (attention/fast_coupling.py); auto: compiled on GPU, eager on CPU
COUPLING_IMPLS = ("auto", "eager", "compiled")
INTEGRATOR_STEPS: tuple[int, int] = math_constant("INTEGRATOR_STEPS")  # attention.steps
# attention.differential_kernel: auto (attention/differential.py picks) or a form of the math
DIFFERENTIAL_KERNELS: tuple[str, ...] = math_constant("DIFFERENTIAL_KERNELS")
DIFFERENTIAL_KERNEL_SETTINGS = ("auto", *DIFFERENTIAL_KERNELS)
# attention.differential_norm: what follows out1 - lambda out2 (plain_math.py says each)
DIFFERENTIAL_NORMS: tuple[str, ...] = math_constant("DIFFERENTIAL_NORMS")
