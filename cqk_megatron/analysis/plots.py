"""PNG figures of the report (matplotlib's Agg renderer: no display needed).

Every figure has labelled axes with units: tokens and FLOPs on log axes, loss in nats
per token, sizes in parameters. One colour per attention variant across all figures.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import (  # noqa: E402
    FixedLocator,
    FuncFormatter,
    LogLocator,
    NullFormatter,
    NullLocator,
)

from cqk_megatron.analysis.ingest import humanize_count  # noqa: E402
from cqk_megatron.config import VARIANTS  # noqa: E402
from cqk_megatron.run.atomic import atomic_path  # noqa: E402

_PALETTE = plt.get_cmap("tab10").colors
VARIANT_COLORS = {name: _PALETTE[i % len(_PALETTE)] for i, name in enumerate(VARIANTS)}
LOSS_LABEL = "validation loss (nats/token)"


def variant_color(variant: str):
    return VARIANT_COLORS.get(variant, _PALETTE[hash(variant) % len(_PALETTE)])


def save(fig, path: Path) -> Path:
    """Write the PNG through a temporary name (no half-written image on a crash)."""
    path = Path(path)
    with atomic_path(path) as temporary:
        fig.savefig(temporary, format="png", dpi=120)
    plt.close(fig)
    return path


def _log_count_axis(ax, axis: str = "x") -> None:
    """Log scale with plain labels (200K, 1M, 3B) on major ticks only: the default minor
    labels (2x10^5, 3x10^5, ...) overlap on short ranges."""
    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    target.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    target.set_major_formatter(FuncFormatter(lambda value, _: humanize_count(value)))
    target.set_minor_formatter(NullFormatter())


def _log_flops_axis(ax) -> None:
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())


def _grid(count: int, width: float = 4.6, height: float = 3.6):
    cols = min(count, 3)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:count])


def loss_curves(table: pd.DataFrame, path: Path, baseline: str = "standard") -> Path:
    """One panel per model size: training (thin) and validation (markers) loss vs tokens,
    from the first evaluation on (the flat start says nothing about the variants); under
    it, when the baseline is there, each variant's validation loss minus the baseline's at
    the same step, the gap the top panel is too coarse to show."""
    from matplotlib.gridspec import GridSpec

    sizes = table.groupby("size")["params_total"].min().sort_values().index.tolist()
    with_gap = baseline in set(table["variant"]) and table["variant"].nunique() > 1
    cols = min(len(sizes), 3)
    grid_rows = math.ceil(len(sizes) / cols)
    panel_rows = 2 if with_gap else 1
    fig = plt.figure(figsize=(4.8 * cols, (5.4 if with_gap else 3.6) * grid_rows))
    grid = GridSpec(
        panel_rows * grid_rows, cols, figure=fig, height_ratios=[3, 1.6][:panel_rows] * grid_rows
    )
    first_gap = None
    for i, size in enumerate(sizes):
        row, col = divmod(i, cols)
        ax = fig.add_subplot(grid[panel_rows * row, col])
        here = table[table["size"] == size]
        valid_here = here[here["split"] == "valid"]
        start = valid_here["tokens"].min() / 2 if len(valid_here) else here["tokens"].min()
        shown, labelled = [], set()
        for _, rows in here.groupby("run"):
            variant = rows["variant"].iloc[0]
            color = variant_color(variant)
            train = rows[rows["split"] == "train"].sort_values("tokens")
            if len(train):
                window = max(1, len(train) // 20)
                smooth = train["loss"].rolling(window, min_periods=1).mean()
                visible = train["tokens"] >= start
                ax.plot(train["tokens"][visible], smooth[visible], color=color, alpha=0.35, lw=1)
                shown.extend(smooth[visible])
            valid = rows[rows["split"] == "valid"].sort_values("tokens")
            if len(valid):
                label = variant if variant not in labelled else None
                labelled.add(variant)
                ax.plot(
                    valid["tokens"], valid["loss"], "o-", color=color, ms=3.5, lw=1.4, label=label
                )
                shown.extend(valid["loss"])
        if shown:
            low, high = min(shown), max(shown)
            ax.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low))
        non_embedding = here["params_non_embedding"].min()
        ax.set_title(f"{size} parameters ({humanize_count(non_embedding)} non-embedding)")
        _log_count_axis(ax)
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, title="validation (dots), train (thin)", title_fontsize=7)
        if not with_gap:
            ax.set_xlabel("tokens seen")
            continue
        # one gap scale for every size, so that sizes compare at a glance
        gap_ax = fig.add_subplot(grid[panel_rows * row + 1, col], sharex=ax, sharey=first_gap)
        first_gap = first_gap or gap_ax
        _validation_gap(gap_ax, valid_here, baseline)
        ax.tick_params(labelbottom=False)
    fig.suptitle("Loss curves per model size and attention variant")
    fig.tight_layout()
    return save(fig, path)


def _validation_gap(ax, valid: pd.DataFrame, baseline: str) -> None:
    """Each variant's mean validation loss (over seeds) minus the baseline's, per step."""
    mean = valid.groupby(["variant", "step"]).agg(loss=("loss", "mean"), tokens=("tokens", "max"))
    ax.axhline(0.0, color=variant_color(baseline), lw=1.2, label=baseline)
    if baseline in mean.index.get_level_values("variant"):
        base = mean.loc[baseline, "loss"]
        for variant in mean.index.get_level_values("variant").unique():
            if variant == baseline:
                continue
            mine = mean.loc[variant]
            common = mine.index.intersection(base.index)
            gap = mine.loc[common, "loss"] - base.loc[common]
            ax.plot(
                mine.loc[common, "tokens"], gap, "o-", color=variant_color(variant), ms=3, lw=1.2
            )
    _log_count_axis(ax)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel(f"val. loss − {baseline}'s\n(nats; below 0: better)", fontsize=8)
    ax.grid(alpha=0.3, which="both")


def compute_frontier(points: pd.DataFrame, compute_fits: dict, path: Path) -> Path:
    """Validation loss vs training FLOPs per variant: the frontier points the ``L(C)`` fit
    uses (filled), the other evaluations (hollow), and the fitted curve."""
    from cqk_megatron.analysis.fits import compute_frontier as frontier_mask

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for variant, rows in points.groupby("variant"):
        color = variant_color(variant)
        on = frontier_mask(rows["flops"], rows["loss"])
        if on.sum() < 3:  # the fit then takes every point (fits._fit_compute_law)
            on[:] = True
        ax.scatter(rows["flops"][on], rows["loss"][on], s=22, color=color, zorder=3)
        ax.scatter(rows["flops"][~on], rows["loss"][~on], s=16, facecolors="none", edgecolors=color)
        fit = compute_fits.get(variant)
        if fit is not None:
            grid = np.geomspace(rows["flops"].min() / 2, rows["flops"].max() * 4, 100)
            label = f"{variant}: {fit.E:.2f} + {fit.A:.3g}·C^-{fit.a:.3f}"
            ax.plot(grid, fit.predict(grid), color=color, lw=1.8, label=label)
        else:
            ax.plot([], [], "o", color=color, label=f"{variant} (no fit)")
    ax.scatter([], [], s=22, color="gray", label="on the frontier (fitted)")
    ax.scatter([], [], s=16, facecolors="none", edgecolors="gray", label="other evaluations")
    _log_flops_axis(ax)
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel(LOSS_LABEL)
    ax.set_title("Loss vs compute: the frontier and its fit L(C) = E + A·C^-a")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save(fig, path)


def chinchilla_fits(points: pd.DataFrame, fits: dict, path: Path, n_column: str) -> Path:
    """One panel per variant: points by size and the fitted L(N, D) curve of each size."""
    variants = [v for v in points["variant"].unique()]
    fig, axes = _grid(len(variants))
    cmap = plt.get_cmap("viridis")  # used up to 0.8: its yellow end vanishes on white
    for ax, variant in zip(axes, variants, strict=True):
        rows = points[points["variant"] == variant]
        sizes = sorted(rows[n_column].unique())
        fit = fits.get(variant)
        for i, n in enumerate(sizes):
            color = cmap(0.8 * i / max(len(sizes) - 1, 1))
            here = rows[rows[n_column] == n]
            ax.scatter(
                here["tokens"], here["loss"], s=14, color=color, label=f"N={humanize_count(n)}"
            )
            if fit is not None:
                grid = np.geomspace(here["tokens"].min() / 2, here["tokens"].max() * 4, 60)
                ax.plot(grid, fit.predict(n, grid), color=color, lw=1.2)
        title = (
            variant
            if fit is None
            else (f"{variant}: α={fit.alpha:.2f}, β={fit.beta:.2f}, E={fit.E:.2f}")
        )
        ax.set_title(title, fontsize=10)
        _log_count_axis(ax)
        ax.set_xlabel("tokens D")
        ax.set_ylabel(LOSS_LABEL)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle("Fitted L(N, D) = E + A/N^α + B/D^β (curves) against validation points")
    fig.tight_layout()
    return save(fig, path)


def multiplier_vs_size(multipliers: dict, path: Path, baseline: str = "standard") -> Path:
    """Data-efficiency multiplier over the baseline vs size: at the measured sizes (filled,
    with their intervals), from the fits alone (hollow), and where the runs do not
    identify it (a cross at the point, no bar: its interval is not a measurement)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    shown = [1.0]
    for offset, (variant, frame) in enumerate(multipliers.items()):
        color = variant_color(variant)
        frame = frame[np.isfinite(frame["multiplier"]) & (frame["multiplier"] > 0)]
        x = frame["params"].to_numpy() * (1 + 0.04 * offset)  # dodge overlapping bars
        for key, rows in frame.groupby(["extrapolated", "identified"], sort=False):
            extrapolated, identified = key
            here = x[frame.index.get_indexer(rows.index)]
            y = rows["multiplier"].to_numpy()
            label = f"{variant}, {'from the fits' if extrapolated else 'measured sizes'}"
            if not identified:
                ax.plot(here, y, "x", color=color, ms=8, label=f"{label}: not identified")
                shown.extend(y)
                continue
            errors = np.vstack([y - rows["low"].to_numpy(), rows["high"].to_numpy() - y])
            face = "none" if extrapolated else color
            ax.errorbar(
                here, y, yerr=errors, fmt="o", color=color, mfc=face, capsize=3, label=label
            )
            shown.extend([*y, *rows["low"], *rows["high"]])
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    _log_count_axis(ax)
    _multiplier_axis(ax, shown)
    ax.set_xlabel("model size N (non-embedding parameters)")
    ax.set_ylabel(f"multiplier: tokens {baseline} needs\n/ tokens the variant needs (×)")
    extrapolated = any(frame["extrapolated"].any() for frame in multipliers.values())
    ax.set_title(
        f"Data-efficiency multiplier over {baseline} attention (bars: bootstrap intervals)\n"
        "filled: at each measured size's N and training tokens"
        + ("; hollow: from the fits" if extrapolated else ""),
        fontsize=10,
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save(fig, path)


def _multiplier_axis(ax, values) -> None:
    """A log axis with about five labelled ticks (1.05×, 1.1×, ...) over the values shown:
    the default decade ticks leave a range such as 0.9× to 1.2× with one label or none."""
    values = np.asarray([v for v in values if np.isfinite(v) and v > 0])
    low, high = float(values.min()) / 1.05, float(values.max()) * 1.05
    ax.set_yscale("log")
    ax.set_ylim(low, high)
    ticks = sorted({float(f"{t:.2g}") for t in np.geomspace(low, high, 6)[1:-1]} | {1.0})
    ax.yaxis.set_major_locator(FixedLocator([t for t in ticks if low <= t <= high]))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}×"))
    ax.yaxis.set_minor_locator(NullLocator())
