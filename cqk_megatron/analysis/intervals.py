"""Bootstrap intervals centred on their point estimate, and when a quantity is identified.

A percentile interval (the quantiles of the replicates) need not contain the point
estimate: when the replicates all fall on one side of it, as they do when a fit has
barely enough runs, the interval starts at the point (``A = 6.18 [6.18, 3.89e+04]``) or
misses it. The interval here is the symmetric bootstrap interval: the point estimate
plus or minus the ``level`` quantile of the replicates' distance from it, measured on a
log scale for positive quantities (constants, multipliers, sizes), where it reads
"within a factor of". It contains its point estimate by construction, and is as wide as
the replicates' spread on their wider side.

A quantity is "not identified by these runs" when its interval spans more than a decade
(or reaches zero or infinity): the runs then say nothing about its value worth printing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

NOT_IDENTIFIED = "not identified by these runs"
MAX_DECADES = 1.0  # an interval wider than this many factors of 10 is not a measurement


@dataclass(frozen=True)
class Interval:
    """A point estimate, its centred interval (nan: no replicates), and whether the runs
    identify it; ``reason`` says why not."""

    point: float
    low: float
    high: float
    identified: bool = True
    reason: str = ""

    def contains_point(self) -> bool:
        return math.isnan(self.low) or self.low <= self.point <= self.high

    def as_dict(self) -> dict:
        return {
            "point": self.point,
            "low": self.low,
            "high": self.high,
            "identified": self.identified,
            "reason": self.reason,
        }


def centred_interval(point: float, replicates, level: float, log_scale: bool) -> tuple:
    """``(low, high)``: ``point`` -/+ the ``level`` quantile of ``|replicate - point|``
    (of ``|log replicate - log point|`` on a log scale; an infinite replicate is infinitely
    far). ``(nan, nan)`` without replicates."""
    values = np.asarray(replicates, dtype=float)
    values = values[~np.isnan(values)]
    if values.size == 0 or math.isnan(point):
        return math.nan, math.nan
    if log_scale:
        if point <= 0 or math.isinf(point):
            return 0.0, math.inf
        with np.errstate(divide="ignore"):
            distance = np.abs(np.log(np.where(values > 0, values, 0.0)) - math.log(point))
        spread = float(np.quantile(distance, level, method="higher"))
        if math.isinf(spread):
            return 0.0, math.inf
        return point * math.exp(-spread), point * math.exp(spread)
    distance = np.abs(values - point)
    spread = float(np.quantile(distance, level, method="higher"))
    return point - spread, point + spread


def spans_more_than_a_decade(low: float, high: float) -> bool:
    """Whether ``[low, high]`` is wider than ``MAX_DECADES`` (for a positive quantity: an
    interval reaching zero or below spans infinitely many)."""
    if math.isnan(low):
        return False
    if low <= 0 or math.isinf(high):
        return True
    return math.log10(high / low) > MAX_DECADES


def interval(
    point: float, replicates, level: float, log_scale: bool = True, unidentified: str = ""
) -> Interval:
    """The centred interval of ``point``; not identified when ``unidentified`` gives a
    reason (such as too few model sizes), or when the interval spans more than a decade."""
    low, high = centred_interval(point, replicates, level, log_scale)
    if unidentified:
        return Interval(point, low, high, False, unidentified)
    if math.isinf(point) or spans_more_than_a_decade(low, high):
        reason = f"its {level:.0%} interval spans more than {MAX_DECADES:g} decade"
        if not math.isnan(low):
            reason += f" ({_plain(low)} to {_plain(high)})"
        return Interval(point, low, high, False, reason)
    return Interval(point, low, high)


def _plain(value: float) -> str:
    return "∞" if math.isinf(value) else f"{value:.3g}"


def format_interval(found: Interval, fmt=None) -> str:
    """``point [low, high]``, or the point alone without replicates, or "not identified
    by these runs" with no number: a number there would be read as a measurement."""
    fmt = fmt or "{:.3g}".format
    if not found.identified:
        return NOT_IDENTIFIED
    if math.isnan(found.low):
        return fmt(found.point)
    return f"{fmt(found.point)} [{fmt(found.low)}, {fmt(found.high)}]"
