"""The experiment planner: from variants, sizes, token budgets and seeds to validated run
configs, below both ``launch/`` and ``analysis/`` (it imports neither, nor the training
engine, and starts no process).

- ``preflight``: what can be checked from files before a job is queued or a process
  group is built (data, checkpoints, lease, memory).
- ``runs``: the one place a variant becomes config fields (``variant_overrides``,
  ``with_variant``), and the one that plans and validates a run (``plan_config``).
- ``parameters``: a model's parameter count without building Megatron's model or
  starting a process group.
- ``sweep``: a sweep file (sizes x variants x token budgets x seeds) expanded into
  validated runs with their resources; ``launch`` submits them (``--sweep``) and
  ``cqk analyze ladder`` lists them.
"""
