"""Scaling-law fits: Chinchilla's approach 3 and loss-versus-compute power laws.

``L(N, D) = E + A / N^alpha + B / D^beta`` (Hoffmann et al., 2022, approach 3), fitted as
Besiroglu et al. (2024) replicated it: in log space, ``LSE(a - alpha log N,
b - beta log D, e)`` against ``log L`` with ``A = e^a, B = e^b, E = e^e``, a Huber loss
with delta 1e-3, L-BFGS, and a grid of initialisations (alpha, beta in 0..2, e in -1..1,
a, b in 0..25). The objective is evaluated at every grid point first and L-BFGS starts
from the best few (the grid only ranks basins; L-BFGS from the best ones reaches the
minimum that a start from every point finds, at a fraction of the cost, which is what
makes bootstrapping affordable). Confidence intervals come from a bootstrap over runs
(all of a run's points go together, since they share a model and a schedule), centred on
the point fit (``intervals``). The size term's constants E, A and alpha are fixed by the
model sizes alone: with fewer than ``MIN_SIZES`` sizes they are not identified, whatever
their bootstrap says.

``L(C) = E + A C^-a`` is fitted the same way on the compute frontier (the points no
cheaper point beats).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.optimize import minimize
from scipy.special import logsumexp

from cqk_megatron.analysis.intervals import Interval, interval

HUBER_DELTA = 1e-3
# E + A/N^alpha has three constants that only the model sizes fix (each size's loss
# curve gives one asymptote): three sizes fit them exactly and test nothing; four is the
# least that can.
MIN_SIZES = 4
SIZE_TERM = ("E", "A", "alpha")
LOG_SCALE = frozenset({"E", "A", "B"})  # positive constants: intervals in factors
MAX_LOG_CONSTANT = 300.0  # log A, log B, log E beyond this: the fit ran off
CHINCHILLA_GRID = {
    "alpha": np.arange(0.0, 2.01, 0.5),
    "beta": np.arange(0.0, 2.01, 0.5),
    "e": np.arange(-1.0, 1.01, 0.5),
    "a": np.arange(0.0, 25.01, 5.0),
    "b": np.arange(0.0, 25.01, 5.0),
}
COMPUTE_GRID = {  # in this order: log A at the reference compute, a, e = log E
    "log_a": np.arange(-2.0, 4.01, 1.0),
    "a_exp": np.array([0.02, 0.05, 0.1, 0.2, 0.4, 0.8]),
    "e": np.arange(-1.0, 1.01, 0.5),
}


def _one_blas_thread(function):
    """Run ``function`` with single-threaded BLAS.

    L-BFGS-B on five parameters makes thousands of tiny BLAS calls; a multi-threaded
    OpenBLAS spins up its threads for each, which on a busy machine made the fits 30x
    slower (measured: 58 s against 2 s for the same report).
    """

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:  # optional: only speed depends on it
            limits = contextlib.nullcontext()
        else:
            limits = threadpool_limits(limits=1, user_api="blas")
        with limits:
            return function(*args, **kwargs)

    return wrapper


class FitError(ValueError):
    """Too few or too uniform points for a fit; the message says what is missing."""


def huber(residual: np.ndarray, delta: float = HUBER_DELTA) -> tuple[np.ndarray, np.ndarray]:
    """Huber loss and its derivative, elementwise."""
    clipped = np.clip(residual, -delta, delta)  # the derivative
    return clipped * (residual - 0.5 * clipped), clipped


# ---------------------------------------------------------------------------------------
# L(N, D)
# ---------------------------------------------------------------------------------------


@dataclass
class ChinchillaFit:
    """``L(N, D) = E + A / N^alpha + B / D^beta`` (N parameters, D tokens, L in nats)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float = math.nan
    n_points: int = 0
    n_sizes: int = 0

    def predict(self, n, d):
        n, d = np.asarray(n, dtype=float), np.asarray(d, dtype=float)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def unidentified(self, name: str) -> str:
        """Why the sizes cannot identify parameter ``name`` ("" when they can)."""
        if name in SIZE_TERM and self.n_sizes < MIN_SIZES:
            return f"{self.n_sizes} model sizes; E, A and alpha need at least {MIN_SIZES}"
        return ""

    @property
    def size_term_identified(self) -> bool:
        """Whether the sizes pin E + A/N^alpha down: extrapolating in N needs it."""
        return not self.unidentified("alpha")

    def tokens_to_reach(self, loss, n):
        """Tokens a model of ``n`` parameters needs to reach ``loss`` (inf: never)."""
        loss, n = np.asarray(loss, dtype=float), np.asarray(n, dtype=float)
        gap = loss - self.E - self.A / n**self.alpha
        with np.errstate(divide="ignore", invalid="ignore"):
            tokens = (self.B / gap) ** (1.0 / self.beta)
        return np.where(gap > 0, tokens, np.inf)

    def compute_optimal(self, compute):
        """``(N_opt, D_opt)`` minimising L at ``C = 6 N D`` FLOPs (Hoffmann et al., eq. 4)."""
        compute = np.asarray(compute, dtype=float)
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
        n_opt = g * (compute / 6.0) ** (self.beta / (self.alpha + self.beta))
        return n_opt, compute / (6.0 * n_opt)

    @property
    def exponents(self) -> tuple[float, float]:
        """``(a, b)`` with ``N_opt ~ C^a`` and ``D_opt ~ C^b``."""
        total = self.alpha + self.beta
        return self.beta / total, self.alpha / total

    def params(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k in PARAMS}


PARAMS = ("E", "A", "B", "alpha", "beta")


def _chinchilla_objective(theta, log_n, log_d, log_l, delta):
    """Huber objective of approach 3 in log space, and its gradient (L-BFGS needs both)."""
    a, b, e, alpha, beta = theta
    t_n, t_d = a - alpha * log_n, b - beta * log_d
    top = np.maximum(np.maximum(t_n, t_d), e)  # log-sum-exp, written out for speed
    w_n, w_d, w_e = np.exp(t_n - top), np.exp(t_d - top), np.exp(e - top)
    total = w_n + w_d + w_e
    value, slope = huber(top + np.log(total) - log_l, delta)
    scale = slope / total
    g_n, g_d = (w_n * scale), (w_d * scale)
    gradient = np.array([g_n.sum(), g_d.sum(), (w_e * scale).sum(), -(g_n @ log_n), -(g_d @ log_d)])
    return value.sum(), gradient


def _grid_objective(grid: np.ndarray, log_n, log_d, log_l, delta) -> np.ndarray:
    """The objective at every row ``(a, b, e, alpha, beta)`` of ``grid``, vectorised."""
    a, b, e, alpha, beta = (grid[:, i : i + 1] for i in range(5))
    terms = np.stack(
        [a - alpha * log_n, b - beta * log_d, np.broadcast_to(e, (len(grid), len(log_n)))]
    )
    value, _ = huber(logsumexp(terms, axis=0) - log_l, delta)
    return value.sum(axis=1)


def _chinchilla_grid() -> np.ndarray:
    g = CHINCHILLA_GRID
    return np.array(list(itertools.product(g["a"], g["b"], g["e"], g["alpha"], g["beta"])))


_GRID = _chinchilla_grid()


def _check_points(n, d, loss) -> None:
    if len(loss) < 5:
        raise FitError(f"an L(N, D) fit needs at least 5 points, got {len(loss)}")
    if len(np.unique(n)) < 2 or len(np.unique(d)) < 2:
        raise FitError(
            "an L(N, D) fit needs at least 2 model sizes and 2 token counts; "
            f"got {len(np.unique(n))} size(s) and {len(np.unique(d))} token count(s)"
        )
    if np.any(~np.isfinite(loss)) or np.any(np.asarray(loss) <= 0):
        raise FitError("losses must be finite and positive")


def _fit_chinchilla(
    n, d, loss, delta: float = HUBER_DELTA, starts: int = 16, initial=None
) -> ChinchillaFit:
    """Fit approach 3 to parameters ``n``, tokens ``d`` and losses ``loss`` (nats).

    L-BFGS starts from the ``starts`` best grid points, or from ``initial`` (a list of
    ``(a, b, e, alpha, beta)``) when given, as bootstrap replicates do.
    """
    n, d, loss = (np.asarray(x, dtype=float) for x in (n, d, loss))
    _check_points(n, d, loss)
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(loss)
    if initial is None:
        ranked = np.argsort(_grid_objective(_GRID, log_n, log_d, log_l, delta))
        initial = _GRID[ranked[:starts]]
    best = None
    for theta0 in initial:
        result = minimize(
            _chinchilla_objective,
            np.asarray(theta0, dtype=float),
            args=(log_n, log_d, log_l, delta),
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": 2000, "ftol": 1e-12, "gtol": 1e-9},
        )
        # A start whose constants ran off (exp() would overflow) fits nothing usable:
        # points that barely constrain a term let L-BFGS push it out along a flat valley.
        if not np.all(np.isfinite(result.x)) or max(result.x[:3]) > MAX_LOG_CONSTANT:
            continue
        if best is None or result.fun < best.fun:
            best = result
    if best is None:
        raise FitError(
            "the L(N, D) fit diverged from every start (a constant ran off to infinity): "
            "the points do not constrain it; more sizes or budgets would"
        )
    a, b, e, alpha, beta = best.x
    return ChinchillaFit(
        E=math.exp(e),
        A=math.exp(a),
        B=math.exp(b),
        alpha=float(alpha),
        beta=float(beta),
        objective=float(best.fun),
        n_points=len(loss),
        n_sizes=len(np.unique(n)),
    )


def _theta(fit: ChinchillaFit) -> np.ndarray:
    return np.array([math.log(fit.A), math.log(fit.B), math.log(fit.E), fit.alpha, fit.beta])


# ---------------------------------------------------------------------------------------
# bootstrap
# ---------------------------------------------------------------------------------------


@dataclass
class Bootstrap:
    """A point fit and its bootstrap replicates (same class as the point fit)."""

    point: object
    samples: list = field(default_factory=list)
    failed: int = 0

    def values(self, name: str) -> np.ndarray:
        return np.array([getattr(s, name) for s in self.samples])

    def estimate(self, name: str, level: float = 0.95) -> Interval:
        """A parameter's point value, its interval centred on it (``intervals``), and
        whether these runs identify it."""
        point = float(getattr(self.point, name))
        why = self.point.unidentified(name) if hasattr(self.point, "unidentified") else ""
        return interval(point, self.values(name), level, name in LOG_SCALE, why)

    def interval(self, name: str, level: float = 0.95) -> tuple[float, float]:
        """``(low, high)`` of ``estimate``: it always contains the point value."""
        found = self.estimate(name, level)
        return found.low, found.high


def _resample_indices(groups: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Indices of a bootstrap sample: whole groups (runs) drawn with replacement."""
    labels = np.unique(groups)
    members = {label: np.flatnonzero(groups == label) for label in labels}
    drawn = rng.choice(labels, size=len(labels), replace=True)
    return np.concatenate([members[label] for label in drawn])


@_one_blas_thread
def bootstrap_chinchilla(n, d, loss, groups=None, n_boot: int = 200, seed: int = 0) -> Bootstrap:
    """Point fit plus ``n_boot`` refits on resampled runs (or points, without ``groups``).

    Each replicate starts L-BFGS from the point fit and from the best grid point of the
    full data: replicates are perturbations of the same data, so their minima sit near
    those starts, and the full grid per replicate would cost 100x more for the same fits.
    """
    n, d, loss = (np.asarray(x, dtype=float) for x in (n, d, loss))
    groups = np.arange(len(loss)) if groups is None else np.asarray(groups)
    point = _fit_chinchilla(n, d, loss)
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(loss)
    best_grid = _GRID[np.argmin(_grid_objective(_GRID, log_n, log_d, log_l, HUBER_DELTA))]
    rng = np.random.default_rng(seed)
    result = Bootstrap(point)
    for _ in range(n_boot):
        index = _resample_indices(groups, rng)
        try:
            sample = _fit_chinchilla(
                n[index], d[index], loss[index], initial=[_theta(point), best_grid]
            )
        except FitError:
            result.failed += 1  # a resample with one size or one budget cannot be fitted
            continue
        result.samples.append(sample)
    return result


# ---------------------------------------------------------------------------------------
# L(C)
# ---------------------------------------------------------------------------------------


@dataclass
class ComputeFit:
    """``L(C) = E + A C^-a`` with ``C`` in FLOPs."""

    E: float
    A: float
    a: float
    objective: float = math.nan
    n_points: int = 0

    def predict(self, compute):
        return self.E + self.A * np.asarray(compute, dtype=float) ** (-self.a)

    def compute_to_reach(self, loss):
        loss = np.asarray(loss, dtype=float)
        gap = loss - self.E
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(gap > 0, (self.A / gap) ** (1.0 / self.a), np.inf)


def compute_frontier(compute, loss) -> np.ndarray:
    """Mask of points on the lower envelope: no point with less compute has lower loss."""
    compute, loss = np.asarray(compute, dtype=float), np.asarray(loss, dtype=float)
    order = np.argsort(compute, kind="stable")
    mask = np.zeros(len(compute), dtype=bool)
    best = math.inf
    for i in order:
        if loss[i] < best:
            mask[i] = True
            best = loss[i]
    return mask


def _compute_objective(theta, log_c, log_l, delta):
    """Huber objective of ``log L(C)`` in log space, and its gradient."""
    log_a, a_exp, e = theta
    t_c = log_a - a_exp * log_c
    top = np.maximum(t_c, e)
    w_c, w_e = np.exp(t_c - top), np.exp(e - top)
    total = w_c + w_e
    value, slope = huber(top + np.log(total) - log_l, delta)
    g_c, g_e = w_c * slope / total, w_e * slope / total
    return value.sum(), np.array([g_c.sum(), -(g_c @ log_c), g_e.sum()])


_COMPUTE_GRID = np.array(list(itertools.product(*COMPUTE_GRID.values())))  # (log_a, a, e)


def _fit_compute_law(
    compute,
    loss,
    delta: float = HUBER_DELTA,
    frontier: bool = True,
    starts: int = 6,
    initial: list[ComputeFit] | None = None,
) -> ComputeFit:
    """Fit ``L(C)``, on the compute frontier by default.

    L-BFGS starts from the best ``starts`` grid points, plus any ``initial`` fits
    (bootstrap replicates start from the point fit).
    """
    compute, loss = np.asarray(compute, dtype=float), np.asarray(loss, dtype=float)
    if frontier:
        mask = compute_frontier(compute, loss)
        if mask.sum() >= 3:
            compute, loss = compute[mask], loss[mask]
    if len(np.unique(compute)) < 4:  # three parameters: three points fit exactly, say nothing
        raise FitError(
            f"an L(C) fit needs at least 4 distinct compute points, got {len(np.unique(compute))}"
        )
    # Work with C relative to a reference so that log A stays O(1) in the grid.
    reference = float(np.exp(np.mean(np.log(compute))))
    log_c, log_l = np.log(compute / reference), np.log(loss)
    grid = _COMPUTE_GRID
    terms = np.stack(
        [
            grid[:, :1] - grid[:, 1:2] * log_c,
            np.broadcast_to(grid[:, 2:3], (len(grid), len(log_c))),
        ]
    )
    ranked = np.argsort(huber(logsumexp(terms, axis=0) - log_l, delta)[0].sum(axis=1))
    candidates = list(grid[ranked[:starts]])
    for fit in initial or []:  # the same law, written for this reference compute
        candidates.append(
            np.array([math.log(fit.A) - fit.a * math.log(reference), fit.a, math.log(fit.E)])
        )
    best = None
    for theta0 in candidates:
        result = minimize(
            _compute_objective,
            theta0,
            args=(log_c, log_l, delta),
            jac=True,
            method="L-BFGS-B",
            bounds=[(None, None), (1e-6, 5.0), (None, None)],
            options={"maxiter": 500, "ftol": 1e-12, "gtol": 1e-9},
        )
        if best is None or result.fun < best.fun:
            best = result
    log_a, a_exp, e = best.x
    return ComputeFit(
        E=math.exp(e),
        A=math.exp(log_a) * reference**a_exp,
        a=float(a_exp),
        objective=float(best.fun),
        n_points=len(loss),
    )


@_one_blas_thread
def bootstrap_compute_law(
    compute, loss, groups=None, n_boot: int = 200, seed: int = 0
) -> Bootstrap:
    compute, loss = np.asarray(compute, dtype=float), np.asarray(loss, dtype=float)
    groups = np.arange(len(loss)) if groups is None else np.asarray(groups)
    result = Bootstrap(_fit_compute_law(compute, loss))
    rng = np.random.default_rng(seed)
    for _ in range(n_boot):
        index = _resample_indices(groups, rng)
        try:
            sample = _fit_compute_law(compute[index], loss[index], starts=1, initial=[result.point])
            result.samples.append(sample)
        except FitError:
            result.failed += 1
    return result


fit_chinchilla = _one_blas_thread(_fit_chinchilla)
fit_compute_law = _one_blas_thread(_fit_compute_law)
