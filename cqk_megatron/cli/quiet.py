"""Third-party warnings a user cannot act on, kept off the terminal unless asked for.

Importing Megatron-Core on a machine without Transformer Engine or Apex prints seven
``UserWarning``s (fourteen lines, before every ``cqk train``, ``cqk params`` and ``cqk data
demo-corpus``, and once per rank under torchrun) about fallbacks that are the expected
CPU path; ``cqk check`` already says whether Apex and Transformer Engine are installed.
``cqk --verbose COMMAND`` shows them again: it sets ``CQK_VERBOSE=1``, which the ranks a
command starts inherit.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

VERBOSE_ENV = "CQK_VERBOSE"
# The start of each message (``warnings.filterwarnings`` matches from the start).
UNACTIONABLE = (
    r"Transformer Engine and Apex are not installed",  # megatron.core.optimizer, fsdp
    r"Apex is not installed\. Falling back to Torch Norm",  # megatron.core.models
    r"full scope is deprecated",  # TransformerConfig's cuda_graph_scope default
)


def quiet_third_party_warnings(env: Mapping[str, str] | None = None) -> None:
    """Ignore the warnings of ``UNACTIONABLE`` in this process, unless ``CQK_VERBOSE`` is
    set. Call it before Megatron-Core is imported: it warns while it loads."""
    env = os.environ if env is None else env
    if env.get(VERBOSE_ENV, "") not in ("", "0"):
        return
    for message in UNACTIONABLE:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
