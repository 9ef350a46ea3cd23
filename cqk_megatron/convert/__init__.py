"""Checkpoint conversion between cqk-megatron and Hugging Face transformers.

- ``export_state_dict`` / ``export_checkpoint`` (``hf_export``): a full Megatron state dict
  (or a run's checkpoint) to a Hugging Face folder: native ``LlamaForCausalLM`` for
  standard attention, the remote-code ``CQKForCausalLM`` for every other variant.
- ``import_hf_folder`` / ``import_checkpoint`` (``hf_import``): back to a full state dict
  and ``RunConfig`` (and a run checkpoint).
- ``cqk-convert`` (``cli.main``) on the command line.
"""

from cqk_megatron.convert.errors import ConversionError
from cqk_megatron.convert.hf_export import export_checkpoint, export_state_dict
from cqk_megatron.convert.hf_import import import_checkpoint, import_hf_folder

__all__ = [
    "ConversionError",
    "export_checkpoint",
    "export_state_dict",
    "import_checkpoint",
    "import_hf_folder",
]
