"""cqk-megatron: Coupled Query-Key Dynamics and Differential Attention on Megatron-Core."""

__version__ = "0.1.0"
