"""Performance: FLOPs and MFU (``flops``), memory per GPU (``memory``, ``plan``), the
activation meter (``measure``) and the benchmark command (``bench``).

``flops``, ``memory`` and ``plan`` are pure functions of the ``RunConfig``; ``plan`` is
also ``python -m cqk_megatron.perf.plan`` and gives ``check_fits`` to the training
command; ``python -m cqk_megatron.perf.bench`` compares the variants' speed and memory.
"""

from cqk_megatron.perf.flops import flops_breakdown, flops_per_token, mfu, peak_flops

__all__ = ["flops_breakdown", "flops_per_token", "mfu", "peak_flops"]
