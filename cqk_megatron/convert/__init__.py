"""Checkpoint conversion between cqk-megatron and Hugging Face transformers.

- ``export_state_dict`` / ``export_checkpoint`` (``hf_export``): a full Megatron state dict
  (or a run's checkpoint) to a Hugging Face folder: native ``LlamaForCausalLM`` for
  standard attention, the remote-code ``CQKForCausalLM`` for every other variant.
- ``import_hf_folder`` / ``import_checkpoint`` (``hf_import``): back to a full state dict
  and ``RunConfig`` (and a run checkpoint).
- ``cqk convert`` (``cqk_megatron.cli.convert``) on the command line.

The names below load on first use (PEP 562), so that importing a light module of the
package (``errors``, ``options``) does not load torch and Megatron.
"""

from __future__ import annotations

import importlib
from typing import Any

from cqk_megatron.convert.errors import ConversionError

_LAZY = {
    "export_checkpoint": "cqk_megatron.convert.hf_export",
    "export_state_dict": "cqk_megatron.convert.hf_export",
    "import_checkpoint": "cqk_megatron.convert.hf_import",
    "import_hf_folder": "cqk_megatron.convert.hf_import",
}

__all__ = [
    "ConversionError",
    "export_checkpoint",
    "export_state_dict",
    "import_checkpoint",
    "import_hf_folder",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
