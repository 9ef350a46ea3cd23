"""Estimates, pure functions of a ``RunConfig``: FLOPs and MFU (``flops``), memory per GPU
(``memory``), and which layouts fit (``fit``: ``check_fits`` before training's step 1,
the layout search of ``cqk plan``). Below training, which reports MFU and refuses a layout
that does not fit; the measurements they are checked against live in
``cqk_megatron.bench``."""

from cqk_megatron.perf.flops import flops_breakdown, flops_per_token, mfu, peak_flops

__all__ = ["flops_breakdown", "flops_per_token", "mfu", "peak_flops"]
