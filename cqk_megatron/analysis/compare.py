"""The paper's questions, answered from fits and points.

- data-efficiency multiplier of a variant over standard attention: at ``N`` parameters
  and ``D`` tokens, the tokens standard attention needs to reach the variant's loss,
  divided by ``D`` (the paper: 2.4x at 60M); at the measured sizes it is read at each
  size's own ``N`` and training budget ``D``;
- its trend with model size (extrapolated, at a fixed tokens-per-parameter ratio);
- the size where one variant overtakes another (differential over coupled);
- percentage changes of perplexity against standard at each size, from points;
- seed variance per variant and size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.optimize import brentq

from cqk_megatron.analysis.fits import Bootstrap, ChinchillaFit
from cqk_megatron.analysis.intervals import interval

TOKENS_PER_PARAM = 20.0  # Chinchilla's compute-optimal ratio, the ladder's budget
SEARCH_RANGE = (1e6, 1e13)  # parameters searched for a crossover


def data_efficiency_multiplier(
    variant: ChinchillaFit, baseline: ChinchillaFit, n, tokens
) -> np.ndarray:
    """Tokens ``baseline`` needs to match ``variant``'s loss at (n, tokens), over tokens."""
    target = variant.predict(n, tokens)
    return baseline.tokens_to_reach(target, n) / np.asarray(tokens, dtype=float)


def multiplier_vs_size(
    variant: Bootstrap,
    baseline: Bootstrap,
    sizes,
    tokens_per_param: float = TOKENS_PER_PARAM,
    level: float = 0.9,
    tokens=None,
    unidentified: str = "",
) -> pd.DataFrame:
    """Multiplier at each size (``D = tokens_per_param * N``, or ``tokens``: one D per
    size, such as the budget each size was trained for) with a bootstrap interval
    centred on it, in factors (``intervals``); ``unidentified``: why none of these rows
    is identified (such as extrapolating in N from too few sizes).

    Replicate ``i`` of the variant is paired with replicate ``i`` of the baseline; the
    two were resampled independently, so the interval carries both fits' uncertainty.
    An infinite multiplier (standard never reaches the loss at that size) is infinitely
    far from any finite one: an interval that includes one is not identified.
    """
    sizes = np.asarray(sizes, dtype=float)
    budgets = tokens_per_param * sizes if tokens is None else np.asarray(tokens, dtype=float)
    if budgets.shape != sizes.shape:
        raise ValueError(f"one token budget per size: {len(sizes)} sizes, {len(budgets)} budgets")
    pairs = list(zip(variant.samples, baseline.samples, strict=False))
    rows = []
    for n, tokens in zip(sizes, budgets, strict=True):
        point = float(data_efficiency_multiplier(variant.point, baseline.point, n, tokens))
        replicas = [float(data_efficiency_multiplier(v, b, n, tokens)) for v, b in pairs]
        found = interval(point, replicas, level, log_scale=True, unidentified=unidentified)
        rows.append(
            {
                "params": n,
                "tokens": tokens,
                "multiplier": point,
                "low": found.low,
                "high": found.high,
                "identified": found.identified,
                "reason": found.reason,
            }
        )
    return pd.DataFrame(rows)


def crossover_size(
    challenger: ChinchillaFit,
    incumbent: ChinchillaFit,
    tokens_per_param: float = TOKENS_PER_PARAM,
    search=SEARCH_RANGE,
) -> float | None:
    """Smallest size above which ``challenger``'s loss drops below ``incumbent``'s.

    Searched on a log grid of ``search`` with ``D = tokens_per_param * N``; None when
    the sign of the difference does not change from incumbent-better to
    challenger-better in that range.
    """

    def gap(log_n: float) -> float:
        n = math.exp(log_n)
        tokens = tokens_per_param * n
        return float(challenger.predict(n, tokens) - incumbent.predict(n, tokens))

    grid = np.linspace(math.log(search[0]), math.log(search[1]), 200)
    values = np.array([gap(x) for x in grid])
    for i in range(len(grid) - 1):
        if values[i] > 0 >= values[i + 1]:
            return math.exp(brentq(gap, grid[i], grid[i + 1]))
    return None


@dataclass
class Crossover:
    size: float | None  # from the point fits
    low: float  # interval of the size centred on it, over replicates that cross
    high: float
    fraction_crossing: float  # replicates with a crossover in the search range
    replicates: int
    identified: bool = True
    reason: str = ""


def crossover_with_uncertainty(
    challenger: Bootstrap,
    incumbent: Bootstrap,
    tokens_per_param: float = TOKENS_PER_PARAM,
    level: float = 0.9,
) -> Crossover:
    """The crossover size from the point fits, its interval centred on it over the
    replicates that cross (none when the point fits do not), and whether the fits'
    size terms, which the search extrapolates, are identified."""
    point = crossover_size(challenger.point, incumbent.point, tokens_per_param)
    sizes = [
        crossover_size(c, i, tokens_per_param)
        for c, i in zip(challenger.samples, incumbent.samples, strict=False)
    ]
    found = [s for s in sizes if s is not None]
    why = challenger.point.unidentified("alpha") or incumbent.point.unidentified("alpha")
    estimate = interval(math.nan if point is None else point, found, level, True, why)
    return Crossover(
        size=point,
        low=estimate.low,
        high=estimate.high,
        fraction_crossing=len(found) / max(len(sizes), 1),
        replicates=len(sizes),
        identified=estimate.identified,
        reason=estimate.reason,
    )


# ---------------------------------------------------------------------------------------
# from points (published numbers, or the final evaluations of runs)
# ---------------------------------------------------------------------------------------


def percent_change_table(
    points: pd.DataFrame, baseline: str = "standard", metric: str = "ppl"
) -> pd.DataFrame:
    """Per size and variant: the metric and its % change against ``baseline`` there.

    ``points`` has columns ``size`` (a label), ``params`` (a number, for ordering),
    ``variant`` and ``metric``; several rows per (size, variant), such as seeds, are
    averaged, and their range kept.
    """
    points = points.copy()
    # A published range (e.g. over seeds) may come as METRIC_low / METRIC_high columns.
    points["_low"] = points.get(f"{metric}_low", points[metric]).fillna(points[metric])
    points["_high"] = points.get(f"{metric}_high", points[metric]).fillna(points[metric])
    grouped = (
        points.groupby(["size", "variant"], sort=False)
        .agg(
            params=("params", "first"),
            value=(metric, "mean"),
            low=("_low", "min"),
            high=("_high", "max"),
            n=(metric, "size"),
        )
        .reset_index()
    )
    base = grouped[grouped["variant"] == baseline].set_index("size")["value"]
    grouped["baseline"] = grouped["size"].map(base)
    grouped["percent"] = 100 * (grouped["value"] - grouped["baseline"]) / grouped["baseline"]
    grouped["_others"] = grouped["variant"] != baseline  # the baseline first in each size
    ordered = grouped.sort_values(["params", "_others", "variant"]).drop(columns="_others")
    return ordered.reset_index(drop=True)


def crossover_from_points(
    points: pd.DataFrame, challenger: str, incumbent: str, metric: str = "ppl"
) -> float | None:
    """Size where ``challenger`` overtakes ``incumbent``, interpolating log(metric) ratio
    linearly in log(params) between the two measured sizes where its sign flips."""
    table = points.groupby(["params", "variant"])[metric].mean().unstack("variant")
    if challenger not in table or incumbent not in table:
        return None
    gap = np.log(table[challenger]) - np.log(table[incumbent])
    gap = gap.dropna()
    params, values = gap.index.to_numpy(dtype=float), gap.to_numpy()
    for i in range(len(values) - 1):
        if values[i] > 0 >= values[i + 1]:
            x0, x1 = math.log(params[i]), math.log(params[i + 1])
            t = values[i] / (values[i] - values[i + 1])
            return math.exp(x0 + t * (x1 - x0))
    return None


def seed_variance(finals: pd.DataFrame, baseline: str = "standard") -> pd.DataFrame:
    """Spread of final validation loss over seeds, per variant and size.

    ``finals`` has ``variant, size, params_total, seed, final_val_loss``. ``variance_ratio``
    compares each variant's seed variance with the baseline's at the same size.
    """
    finals = finals.dropna(subset=["final_val_loss"])
    grouped = (
        finals.groupby(["size", "variant"], sort=False)
        .agg(
            params=("params_total", "min"),
            seeds=("seed", "nunique"),
            mean_loss=("final_val_loss", "mean"),
            std_loss=("final_val_loss", "std"),
            min_loss=("final_val_loss", "min"),
            max_loss=("final_val_loss", "max"),
        )
        .reset_index()
    )
    grouped["mean_ppl"] = np.exp(grouped["mean_loss"])
    grouped["ppl_range"] = np.exp(grouped["max_loss"]) - np.exp(grouped["min_loss"])
    base = grouped[grouped["variant"] == baseline].set_index("size")["std_loss"]
    grouped["variance_ratio"] = (grouped["std_loss"] / grouped["size"].map(base)) ** 2
    return grouped.sort_values(["params", "variant"]).reset_index(drop=True)
