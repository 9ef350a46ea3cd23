"""Scaling-law analysis over training runs: ingestion, fits, comparisons, reports, ladders.

``cqk-analyze table|fit|report|gains`` (``cqk_megatron.analysis.cli``) is the front door.
"""
