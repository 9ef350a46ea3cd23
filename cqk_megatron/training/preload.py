"""Import this module to import what a rank trains with (torch, Megatron-Core, the model
builder and the training loop) the way the entry points do: with the collector paused,
then frozen (``training.collector``). For a process that forks ranks: a forkserver's
preload list names it (``tests/_multiproc.py``), so that every rank it forks starts with
those imports done and out of the collector's walks."""

from cqk_megatron.training.collector import heavy_imports

with heavy_imports():
    import megatron.core  # noqa: F401
    import torch  # noqa: F401

    import cqk_megatron.model.gpt  # noqa: F401

    # the shipped engines' classes too: the loop imports them by name on first use
    import cqk_megatron.training.engines.deepspeed  # noqa: F401
    import cqk_megatron.training.engines.megatron  # noqa: F401
    import cqk_megatron.training.loop  # noqa: F401
