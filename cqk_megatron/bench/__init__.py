"""Measurements, each against a baseline in the same run: the attention variants' speed and
memory (``variants``, ``cqk bench``), checkpoint saves (``checkpoints``), the activation
meter (``measure``) and each variant's parameter overhead checked against the built model
(``overhead``, ``cqk params``). Above training: they build models and run its pieces;
the estimates they are compared with live in ``cqk_megatron.perf``."""
