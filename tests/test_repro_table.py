"""cqk-repro's comparison table, from per-run rows (no training): the perplexity change
comes with the spread between seeds and a sentence on whether it is inside it, and the
step-time ratio comes from process CPU time or is flagged as wall clock."""

from __future__ import annotations

import math

import pandas as pd

from cqk_megatron.repro.table import compare_variants, confidence_lines, variants_markdown


def runs(ppl: dict[tuple[str, int], float], cpu: float | None = 0.2) -> pd.DataFrame:
    """One row per (variant, seed), as ``table.per_run`` makes them. Wall clock says
    coupled is faster (more tokens/s); CPU time says it costs 1.25x."""
    rows = []
    for (variant, seed), value in ppl.items():
        per_step = None if cpu is None else cpu * (1.25 if variant == "coupled" else 1.0)
        rows.append(
            {
                "run": f"{variant}-s{seed}",
                "variant": variant,
                "seed": seed,
                "val_loss": math.log(value),
                "val_ppl": value,
                "tokens_per_s": 9000.0 if variant == "coupled" else 8000.0,
                "cpu_s_per_step": math.nan if per_step is None else per_step,
                "cpu_s_first_half": math.nan if per_step is None else per_step,
                "cpu_s_second_half": math.nan if per_step is None else per_step,
                "params_total": 7_440_900 if variant == "coupled" else 7_407_872,
                "tokens": 614_400,
            }
        )
    return pd.DataFrame(rows)


def row(table: pd.DataFrame, variant: str) -> pd.Series:
    return table.set_index("variant").loc[variant]


def test_change_inside_the_spread_between_seeds():
    # the cpu-tiny result of docs/results.md: +0.42% against seeds 9.8% apart
    table = compare_variants(
        runs(
            {
                ("standard", 0): 122.54,
                ("standard", 1): 134.57,
                ("coupled", 0): 124.10,
                ("coupled", 1): 134.10,
            }
        ),
        ["standard", "coupled"],
    )
    coupled = row(table, "coupled")
    assert math.isclose(coupled["change_vs_standard_pct"], 100 * (129.10 / 128.555 - 1))
    assert coupled["change_by_seed_pct"] == "+1.27,-0.35"
    assert math.isclose(coupled["seed_spread_pct"], 100 * (134.57 - 122.54) / 128.555)
    assert coupled["change_inside_seed_spread"]
    (line,) = confidence_lines(table)
    assert "+0.42% perplexity against standard" in line
    assert "seed by seed: +1.27%, -0.35%" in line
    assert "9.36% of standard's" in line and "inside the spread between seeds" in line
    assert "cannot be told from seed noise" in variants_markdown(table)


def test_change_outside_the_spread_between_seeds():
    table = compare_variants(
        runs(
            {
                ("standard", 0): 130.0,
                ("standard", 1): 131.0,
                ("coupled", 0): 120.0,
                ("coupled", 1): 120.5,
            }
        ),
        ["standard", "coupled"],
    )
    coupled = row(table, "coupled")
    assert not coupled["change_inside_seed_spread"]
    (line,) = confidence_lines(table)
    assert "outside the spread between seeds" in line and "with 2 seeds" in line


def test_one_seed_says_the_spread_is_not_measured():
    table = compare_variants(
        runs({("standard", 0): 130.0, ("coupled", 0): 120.0}), ["standard", "coupled"]
    )
    assert math.isnan(row(table, "coupled")["seed_spread_pct"])
    (line,) = confidence_lines(table)
    assert "one seed each" in line and "cannot be told from seed noise" in line


def test_step_time_ratio_from_process_cpu_time_not_wall_clock():
    table = compare_variants(
        runs({("standard", 0): 130.0, ("coupled", 0): 120.0}), ["standard", "coupled"]
    )
    coupled = row(table, "coupled")
    assert math.isclose(coupled["step_time_vs_standard"], 1.25)  # wall clock says 0.89
    assert coupled["step_time_clock"] == "process CPU time" and coupled["step_time_steady"]
    markdown = variants_markdown(table)
    assert "| 1.25x (CPU) |" in markdown and "0.89" not in markdown
    assert "other work on a shared machine moves it far less than wall clock" in markdown


def test_step_time_ratio_without_cpu_time_is_flagged():
    table = compare_variants(
        runs({("standard", 0): 130.0, ("coupled", 0): 120.0}, cpu=None),
        ["standard", "coupled"],
    )
    coupled = row(table, "coupled")
    assert coupled["step_time_clock"] == "wall clock" and not coupled["step_time_steady"]
    markdown = variants_markdown(table)
    assert "0.89x (wall clock, unreliable)" in markdown
    assert "measures the machine's load as much as the model" in markdown
