"""Scaling-law analysis over training runs: ingestion, fits, comparisons, reports, ladders.

``cqk analyze table|fit|report|gains|ladder`` (``cqk_megatron.cli.analyze``) is the front
door.
"""
