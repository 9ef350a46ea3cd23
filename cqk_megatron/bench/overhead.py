"""The parameters of each attention variant and its overhead over standard (the table of
``cqk params``, whose command line is ``cqk_megatron/cli/params.py``).

The table is the one count (``cqk_megatron.model.params``, through the planner's
``planner.parameters.config_parameters``: no Megatron model is built and no process group
is started), of each variant's config as the planner makes it (TP=1, PP=1). As a check,
the real Megatron ``GPTModel`` is also built on the meta device (no memory, no
initialisation: 7B counts are instant) and a difference is reported; ``--no-build-check``
skips that.
"""

from __future__ import annotations

from cqk_megatron.config import RunConfig, validate
from cqk_megatron.planner.parameters import config_parameters, variant_config


def count_variant_parameters(config: RunConfig, variant: str) -> int:
    """Total parameters of the built ``GPTModel`` of ``config`` with ``variant`` attention
    (TP=PP=1). It starts a one-process group (Megatron's layers need one): it is the check
    on ``planner.parameters.config_parameters``, which plans and analysis use."""
    import torch

    from cqk_megatron.model.gpt import build_model, count_parameters
    from cqk_megatron.parallel.process_groups import init_single_process

    config = validate(variant_config(config, variant))
    init_single_process(config)
    with torch.device("meta"):
        return count_parameters(build_model(config))


def overhead_table(config: RunConfig, variants: list[str]) -> list[dict]:
    """One row per variant: parameters, extra over standard, and that extra in percent
    (the planner's count; no model is built)."""
    baseline = config_parameters(config, "standard")
    rows = []
    for variant in variants:
        total = config_parameters(config, variant)
        extra = total - baseline
        rows.append(
            {
                "variant": variant,
                "parameters": total,
                "extra": extra,
                "percent": 100 * extra / baseline,
            }
        )
    return rows


def built_differences(config: RunConfig, rows: list[dict]) -> list[str]:
    """A line for each row whose count differs from the built model's."""
    lines = []
    for row in rows:
        built = count_variant_parameters(config, row["variant"])
        if built != row["parameters"]:
            lines.append(
                f"warning: {row['variant']}: the planner counts {row['parameters']:,} "
                f"parameters but the built model has {built:,} (please report)"
            )
    return lines


def format_table(rows: list[dict]) -> str:
    lines = [f"{'variant':<26}{'parameters':>16}{'extra':>12}{'extra %':>10}"]
    for row in rows:
        lines.append(
            f"{row['variant']:<26}{row['parameters']:>16,}{row['extra']:>12,}{row['percent']:>9.3f}%"
        )
    return "\n".join(lines)
