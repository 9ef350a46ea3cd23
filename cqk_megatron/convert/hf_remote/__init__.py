"""Source files of the custom Hugging Face architecture (``model_type: cqk``).

The exporter copies ``configuration_cqk.py`` and ``modeling_cqk.py`` from here,
``cqk_megatron/variants/plain_math.py`` verbatim, and writes ``cqk_variant.py`` (the
variant's classes, ``convert/remote_source.py``) into every non-Llama export;
``AutoModelForCausalLM`` loads them with ``trust_remote_code=True``. They import only
torch and transformers (and ``.coupling`` and ``.cqk_variant`` relatively), never this
package, so they are not meant to be imported from here: ``modeling_cqk``'s relative
imports only resolve inside an exported folder.
"""

from pathlib import Path

REMOTE_CODE_DIR = Path(__file__).resolve().parent
REMOTE_CODE_FILES = ("configuration_cqk.py", "modeling_cqk.py")
