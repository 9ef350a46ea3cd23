"""The one error type for bad data files, tokenizers and dataset folders."""

from __future__ import annotations

from cqk_megatron.errors import Refusal


class DataError(Refusal, ValueError):
    """Bad input data or output location; the message names the file and the fix."""
