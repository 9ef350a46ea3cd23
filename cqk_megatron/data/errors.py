"""The one error type for bad data files, tokenizers and dataset folders."""

from __future__ import annotations


class DataError(ValueError):
    """Bad input data or output location; the message names the file and the fix."""
