"""Parameter counts and the overhead of each attention variant over standard attention.

    cqk-params --config configs/models/150m.yaml [--variants coupled,invertible] [k=v ...]

Models are built on the meta device (no memory, no initialisation), so 7B counts are
instant; the count is that of the real Megatron ``GPTModel`` at TP=1, PP=1.
"""

from __future__ import annotations

import argparse

import torch

from cqk_megatron.config import VARIANTS, RunConfig, load_config, validate
from cqk_megatron.distributed import init_single_process
from cqk_megatron.model import build_model, count_parameters
from cqk_megatron.planner.parameters import variant_config
from cqk_megatron.variants import UnknownVariantError, pair


def count_variant_parameters(config: RunConfig, variant: str) -> int:
    """Total parameters of the built ``GPTModel`` of ``config`` with ``variant`` attention
    (TP=PP=1). It starts a one-process group (Megatron's layers need one): what counts
    without one, for plans and analysis, is ``planner.parameters.count_parameters``."""
    config = validate(variant_config(config, variant))
    init_single_process(config)
    with torch.device("meta"):
        return count_parameters(build_model(config))


def overhead_table(config: RunConfig, variants: list[str]) -> list[dict]:
    """One row per variant: parameters, extra over standard, and that extra in percent."""
    baseline = count_variant_parameters(config, "standard")
    rows = []
    for variant in variants:
        total = count_variant_parameters(config, variant)
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
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    variants = [v for v in args.variants.split(",") if v]
    for variant in variants:
        try:
            pair(variant)
        except UnknownVariantError as error:
            parser.error(str(error))
    print(format_table(overhead_table(config, variants)))


if __name__ == "__main__":
    main()
