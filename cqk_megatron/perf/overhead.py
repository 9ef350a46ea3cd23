"""``cqk-params``: the parameters of each attention variant and its overhead over standard.

    cqk-params --config configs/models/150m.yaml [--variants coupled,invertible] [k=v ...]

The table is the one count (``cqk_megatron.params``, through the planner's
``planner.parameters.count_parameters``: no Megatron model is built and no process group
is started), of each variant's config as the planner makes it (TP=1, PP=1). As a check,
the real Megatron ``GPTModel`` is also built on the meta device (no memory, no
initialisation: 7B counts are instant) and a difference is reported; ``--no-build-check``
skips that.
"""

from __future__ import annotations

import argparse
import sys

from cqk_megatron.config import VARIANTS, RunConfig, load_config, validate
from cqk_megatron.planner.parameters import count_parameters, variant_config
from cqk_megatron.variants import UnknownVariantError, pair


def count_variant_parameters(config: RunConfig, variant: str) -> int:
    """Total parameters of the built ``GPTModel`` of ``config`` with ``variant`` attention
    (TP=PP=1). It starts a one-process group (Megatron's layers need one): it is the check
    on ``planner.parameters.count_parameters``, which plans and analysis use."""
    import torch

    from cqk_megatron.distributed import init_single_process
    from cqk_megatron.model import build_model
    from cqk_megatron.model import count_parameters as count_built

    config = validate(variant_config(config, variant))
    init_single_process(config)
    with torch.device("meta"):
        return count_built(build_model(config))


def overhead_table(config: RunConfig, variants: list[str]) -> list[dict]:
    """One row per variant: parameters, extra over standard, and that extra in percent
    (the planner's count; no model is built)."""
    baseline = count_parameters(config, "standard")
    rows = []
    for variant in variants:
        total = count_parameters(config, variant)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="YAML config (default: built-in tiny)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names")
    parser.add_argument(
        "--no-build-check",
        dest="build_check",
        action="store_false",
        help="skip comparing the planner's count with the model built on the meta device",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    variants = [v for v in args.variants.split(",") if v]
    for variant in variants:
        try:
            pair(variant)
        except UnknownVariantError as error:
            parser.error(str(error))
    rows = overhead_table(config, variants)
    print(format_table(rows))
    if args.build_check:
        for line in built_differences(config, rows):
            print(line, file=sys.stderr)


if __name__ == "__main__":
    main()
