"""Keep the garbage collector off the objects a process holds for its whole life.

Importing torch, Megatron-Core and DeepSpeed makes about 450,000 objects, and the
collector walks all of them again and again while they are made: seven full collections,
2 of the 6 CPU-s those imports cost here. Set-up then runs more: DeepSpeed's explicit
``gc.collect()`` calls while it builds its optimizer (``see_memory_usage``,
``defragment``), Megatron's (datasets, checkpoints), each walking every object (0.24 CPU-s
at 450,000). Nearly all of those objects (modules, then the model, its engine and the
datasets) live as long as the process.

``heavy_imports()`` runs imports with the collector paused and then freezes what exists
(``gc.freeze()``: later collections skip it; reference counting still frees it; only
cycles dropped during the imports stay, 8 MB here). The entry points import the training
loop under it and DeepSpeed's engine imports DeepSpeed under it; ``train`` collects and
freezes at its start and again once the model, engine and datasets exist. A one-rank
DeepSpeed run of ``configs/runs/tiny_cpu.yaml`` spends about 2 CPU-s less in ``train``
(4.3 to 2.0) and 2 CPU-s less importing it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def heavy_imports() -> Iterator[None]:
    """Import torch, Megatron-Core, DeepSpeed or the training loop in this block: no
    collection runs while they load, and what they made is then frozen."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()  # no collection first: avoiding that walk is the point
        if was_enabled:
            gc.enable()


def freeze_long_lived() -> None:
    """Collect, then take every object that is left out of the collector's view. The one
    walk sees only what is not frozen yet; garbage is not frozen with the rest (a caller
    such as a test process may hold much of it)."""
    gc.collect()
    gc.freeze()
