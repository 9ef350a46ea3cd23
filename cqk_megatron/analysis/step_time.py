"""Step time of runs, and its ratio against a baseline, from a clock that other work on a
shared machine barely moves.

Wall-clock step time (``step_time_s``, ``tokens_per_s`` in the train records) measures the
machine as much as the model: on a machine shared with other work it moves by tens of
per cent from one run to the next. The process CPU time of the training process
(``process_cpu_s``, cumulative, in every train record since it was added) counts only the
work this process did, which is what a variant changes; contention still reaches it
through shared caches and cores (two demo ladders on a heavily loaded 2-core machine gave
the same ratios to within about 5 points), far less than it reaches wall clock. A run's
CPU seconds per step is the median over its consecutive train records of (CPU time
between them) / (steps between them): the records around an evaluation or a checkpoint,
and the first after a resume (a new process restarts the count), fall out of the median.

A ratio is reported with the clock it came from. From process CPU time it is also checked
for steadiness: the ratio over the first half of the runs' steps and over the second half
must agree within ``STEADY_TOLERANCE``, else it is flagged with both values. From wall
clock (runs that predate ``process_cpu_s``) it is always flagged as unreliable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

STEADY_TOLERANCE = 0.05  # relative disagreement of the two halves' ratios
CPU_CLOCK = "process CPU time"
WALL_CLOCK = "wall clock"
WALL_REASON = (
    "wall clock: unreliable on a shared machine (these runs' records have no process CPU "
    "time); measure with cqk bench --clock cpu"
)


@dataclass
class StepTime:
    """CPU seconds per step of one run: over all its steps and over each half of them."""

    cpu: float
    first_half: float
    second_half: float
    wall: float  # median wall-clock step time, for reference only


def _per_step(train: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(step, CPU seconds per step) of each pair of consecutive train records."""
    rows = train.dropna(subset=["process_cpu_s"]).sort_values(["step", "process_cpu_s"])
    steps = rows["step"].to_numpy(dtype=float)
    cpu = rows["process_cpu_s"].to_numpy(dtype=float)
    d_step, d_cpu = np.diff(steps), np.diff(cpu)
    keep = (d_step > 0) & (d_cpu > 0)  # a resumed process restarts its count
    return steps[1:][keep], d_cpu[keep] / d_step[keep]


def run_step_time(train: pd.DataFrame) -> StepTime:
    """``train``: one run's train rows (``step``, ``process_cpu_s``, ``step_time_s``)."""
    wall = train["step_time_s"].dropna() if "step_time_s" in train else pd.Series(dtype=float)
    wall_median = float(wall.median()) if len(wall) else math.nan
    if "process_cpu_s" not in train:
        return StepTime(math.nan, math.nan, math.nan, wall_median)
    steps, per_step = _per_step(train)
    if len(per_step) < 2:
        return StepTime(math.nan, math.nan, math.nan, wall_median)
    middle = (steps.min() + steps.max()) / 2
    first, second = per_step[steps <= middle], per_step[steps > middle]
    return StepTime(
        cpu=float(np.median(per_step)),
        first_half=float(np.median(first)) if len(first) else math.nan,
        second_half=float(np.median(second)) if len(second) else math.nan,
        wall=wall_median,
    )


def step_time_ratios(runs: pd.DataFrame, baseline: str, by: str = "size") -> pd.DataFrame:
    """Per ``by`` group and variant: step time over the baseline's in the same group.

    ``runs`` has one row per run with ``variant``, ``by``, ``cpu_s_per_step``,
    ``cpu_s_first_half``, ``cpu_s_second_half`` and ``tokens_per_s`` (wall clock); runs
    of a group and variant (seeds) are pooled by their median. Columns of the result:
    ``by, variant, cpu_s_per_step, ratio, clock, steady, note``.
    """
    columns = ["cpu_s_per_step", "cpu_s_first_half", "cpu_s_second_half", "tokens_per_s"]
    pooled = runs.groupby([by, "variant"], sort=False)[columns].median().reset_index()
    base = pooled[pooled["variant"] == baseline].set_index(by)
    rows = []
    for _, row in pooled.iterrows():
        group = row[by]
        out = {by: group, "variant": row["variant"], "cpu_s_per_step": row["cpu_s_per_step"]}
        if group not in base.index:
            rows.append({**out, "ratio": math.nan, "clock": "", "steady": False, "note": ""})
            continue
        ref = base.loc[group]
        if np.isfinite(row["cpu_s_per_step"]) and np.isfinite(ref["cpu_s_per_step"]):
            ratio = row["cpu_s_per_step"] / ref["cpu_s_per_step"]
            halves = (
                row["cpu_s_first_half"] / ref["cpu_s_first_half"],
                row["cpu_s_second_half"] / ref["cpu_s_second_half"],
            )
            steady = bool(
                all(np.isfinite(halves)) and abs(halves[0] - halves[1]) <= STEADY_TOLERANCE * ratio
            )
            note = (
                ""
                if steady
                else f"unsteady: {halves[0]:.2f}x over the first half of the steps, "
                f"{halves[1]:.2f}x over the second (more than {STEADY_TOLERANCE:.0%} apart)"
            )
            rows.append({**out, "ratio": ratio, "clock": CPU_CLOCK, "steady": steady, "note": note})
        else:
            ratio = ref["tokens_per_s"] / row["tokens_per_s"]
            rows.append(
                {**out, "ratio": ratio, "clock": WALL_CLOCK, "steady": False, "note": WALL_REASON}
            )
    return pd.DataFrame(rows)


def format_ratio(ratio: float, clock: str, steady: bool) -> str:
    """``1.06x (CPU)`` when it can be trusted; the flag in the cell when it cannot."""
    if ratio is None or not np.isfinite(ratio):
        return ""
    if clock == CPU_CLOCK:
        return f"{ratio:.2f}x (CPU)" if steady else f"{ratio:.2f}x (CPU, unsteady)"
    return f"{ratio:.2f}x (wall clock, unreliable)"
