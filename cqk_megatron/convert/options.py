"""The choices of a conversion that a command line offers, torch-free (``cqk convert
--help`` reads them without loading torch; ``hf_export`` and ``safetensors_io`` use them)."""

EXPORT_DTYPE_NAMES = ("float32", "bfloat16", "float16")  # torch dtypes a weight may be cast to
DEFAULT_MAX_SHARD = "5GB"  # safetensors files are split above this size
