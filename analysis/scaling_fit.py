"""Loss against compute for the two arms of a decision: saturating power-law fits, the compute multiplier
with bootstrap intervals, fit-free multipliers, the rollout check, the A/A null and extrapolations.

The law, in compute ``C`` (training FLOPs), is ``L(C) = E + A * C^(-alpha)``, fitted as in Chinchilla's
Approach 3 refitted by Besiroglu et al. (2024): the Huber loss (``delta`` matched to the seed noise of a
cell mean, ``seed_noise_delta``) of the residuals of ``log L``, with ``log L = LSE(e, a - alpha * log C)``
(``E = exp(e)``, ``A = exp(a)``), minimised by L-BFGS (``scipy.optimize.minimize``, bounded) from a grid of
starts, the best kept. Compute enters relative to the geometric mean of the fitted points (``c_ref``), so
``A`` is the reducible loss there.

Three models (``MODELS``):

* ``single``: one arm, ``(E, A, alpha)``;
* ``shared``: both arms with one exponent and one ``E``, ``L_a(C) = E + A * (k_a * C)^(-alpha)`` with
  ``k_baseline = 1``: ``k`` is the compute multiplier, the variant at ``C`` matching the baseline at
  ``k * C`` (``k > 1``: the variant needs less compute);
* ``free``: both arms with one ``E`` and their own ``(A, alpha)``: the exponent difference, and a
  multiplier that may change with compute. ``E`` is shared because the arms train on the same data
  (the irreducible loss is the data's), and because a 3-parameter fit per arm on 4 or 5 points
  trades ``E`` against ``alpha`` so freely that its exponent says little.

Each arm-and-rung cell enters as the mean of its seeds, weighted by their number. Before any fit a
robust screen (``screen``) leaves out runs that look diverged and names them. A fit that does not
converge (the optimizer fails, a parameter ends at its bound, too few points for its parameters,
degenerate data) comes back with ``status="failed"`` and a ``reason``, never a number. Fits are
deterministic and do not depend on the order of the rows.

Intervals come from a bootstrap that resamples the seeds within each cell, paired across arms (at a
rung where both arms ran the same seeds, one draw of seed indices serves both, since batches are a
function of the seed), and refits. Seed deviations from their cell mean are scaled by
``sqrt(n / (n - 1))`` before resampling, so a resampled mean has the unbiased variance ``s^2 / n``
(without it two seeds give half of it). Where a cell has a single seed the bootstrap resamples the
pooled residuals of the shared fit instead (scaled by ``sqrt(N / (N - p))``).

Intervals are percentile intervals at ``confidence`` whose half-widths about the replicates' median are
widened by ``t_df / z`` (``t_widening``): the bootstrap treats the seed spread as known, but two seeds
per cell estimate it from few degrees of freedom (``df``: one per paired rung and extra seed, or
``N - p`` for resampled residuals), and at 5 rungs x 2 seeds the bare percentile interval covers the
true ``k`` about 85% of the time at a nominal 90% (docs/ladder.md has the measurements). A ``verdict``
names a sign only where the interval excludes the null (``k = 1``, a zero gap or exponent difference),
and, for a fitted statistic, only where every guard passes (``verdict_guards``): no run screened, no cell
missing, the A/A null covering 1 at ``AA_CONFIDENCE``, and the rollout check -- each arm's largest rung
predicted by the fit of the rungs below it with an error whose bootstrap interval (at
``ROLLOUT_CONFIDENCE``) covers zero. A guard that cannot run (an arm without runs, failed refits, too few
replicates for a 99% interval, no A/A seeds) withholds as one that fails. A statistic whose verdict is
withheld keeps its numbers and intervals and says which guards withheld it and why. Every interval needs
``TAIL_REPLICATES`` replicates beyond each end (``min_replicates``: 100 at 90%, 1,000 at 99%).
Bootstrap refits start from the full data's optimum (then its next-best optima) and keep the first that
converges; an interval whose refits fail more than 10% of the time is itself reported as failed.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np
from scipy.optimize import minimize
from scipy.special import ndtri, stdtrit
from threadpoolctl import threadpool_limits

# Huber's delta in log loss is matched to the measured seed noise of a cell mean (``seed_noise_delta``):
# 1.345 standard errors, Huber's constant for 95% efficiency under normal noise, so the fit is least squares
# for seed-sized residuals and robust only beyond them. Without two seeds in any cell there is nothing to
# measure, and this fallback is used (and said).
HUBER_EFFICIENCY = 1.345
HUBER_DELTA = 1e-3
MIN_HUBER_DELTA = 1e-5  # a noiseless ladder (synthetic, or every seed alike) still has a positive delta
ARMS = ("baseline", "variant")
MODELS = {
    "single": ("E", "A", "alpha"),
    "shared": ("E", "A", "alpha", "k"),
    "free": ("E", "A_baseline", "alpha_baseline", "A_variant", "alpha_variant"),
}
VARIANT_BETTER, BASELINE_BETTER, NO_DIFFERENCE = "variant better", "baseline better", "no detectable difference"
# the grid of starts: exponents x irreducible loss as a fraction of the smallest loss; the amplitudes
# (and log k) of each start solve the remaining linear problem
ALPHA_STARTS = (0.15, 0.4, 1.0)
E_FRACTION_STARTS = (0.05, 0.5, 0.9)
ALPHA_BOUNDS = (0.005, 3.0)
LOG_K_BOUND = math.log(1e4)
MAX_FAILED_REPLICATES = 0.1  # an interval needs at least 90% of its bootstrap refits to converge
# The rollout check's confidence: a fit misses when its error at the held-out largest rung, bootstrapped
# (seeds resampled, the smaller rungs refitted), excludes zero at this level for either arm -- 99% so that a
# fit of the right form is flagged about 2% of the time over the two arms
ROLLOUT_CONFIDENCE = 0.99
# The A/A null vetoes fitted verdicts when its k interval at this level excludes 1. At the intervals' own
# 90% it would veto about 10% of true findings by construction; at 99% about 1% (docs/ladder.md).
AA_CONFIDENCE = 0.99
# A percentile interval needs this many replicates beyond each of its ends: 100 at 90%, 1,000 at 99%
TAIL_REPLICATES = 5
# The robust screen: a run whose log loss lies above its reference (the median of its cell's other seeds,
# or the same arm's next smaller rung) by more than this many typical seed differences is named as
# diverged and left out of every fit; the floor keeps a noiseless ladder from flagging rounding
DIVERGED_SPREADS = 10.0
DIVERGED_FLOOR = math.log(1.01)


# -- the fits ------------------------------------------------------------------------------------------
_SERIAL = {"depth": 0}


def single_threaded(function):
    """Run ``function`` with BLAS on one thread: L-BFGS-B makes thousands of tiny LAPACK calls, and a
    threaded BLAS spends most of each waking its threads (far worse on a loaded machine)."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        if _SERIAL["depth"]:
            return function(*args, **kwargs)
        _SERIAL["depth"] += 1
        try:
            with threadpool_limits(limits=1, user_api="blas"):
                return function(*args, **kwargs)
        finally:
            _SERIAL["depth"] -= 1

    return run


@dataclass(frozen=True)
class Points:
    """What a fit sees: one point per cell (compute, mean loss, weight = its number of seeds, arm index
    0 for the baseline and 1 for the variant)."""

    compute: np.ndarray
    loss: np.ndarray
    weight: np.ndarray
    arm: np.ndarray

    @staticmethod
    def of(compute: Sequence[float], loss: Sequence[float], weight=None, arm=None) -> "Points":
        n = len(compute)
        return Points(
            np.asarray(compute, float),
            np.asarray(loss, float),
            np.ones(n) if weight is None else np.asarray(weight, float),
            np.zeros(n, int) if arm is None else np.asarray(arm, int),
        )

    def sorted(self) -> "Points":
        """The same points in a canonical order (arm, compute, loss), so the fit ignores row order."""
        order = np.lexsort((self.loss, self.compute, self.arm))
        return Points(self.compute[order], self.loss[order], self.weight[order], self.arm[order])


@dataclass(frozen=True)
class Fit:
    """A fitted law, or why there is none (``status`` "failed", ``reason``, ``theta`` None)."""

    model: str
    status: str
    reason: str = ""
    theta: Optional[np.ndarray] = None  # (e, a..., alpha..., log k) as optimised
    c_ref: float = float("nan")
    objective: float = float("nan")
    n_points: int = 0
    alternatives: tuple = ()  # the next-best distinct optima: warm starts for bootstrap refits
    note: str = ""  # a boundary solution that is still a fit (E at its lower bound: a pure power law)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def params(self) -> dict[str, float]:
        """The named parameters (``A`` at ``c_ref``); empty when the fit failed."""
        if not self.ok:
            return {}
        t = self.theta
        values = [math.exp(t[0]), math.exp(t[1]), t[2]]
        if self.model == "shared":
            values.append(math.exp(t[3]))
        elif self.model == "free":
            values += [math.exp(t[3]), t[4]]
        return dict(zip(MODELS[self.model], (float(v) for v in values)))

    def predict(self, compute, arm: int = 0) -> np.ndarray:
        """The fitted loss of arm ``arm`` (0 baseline, 1 variant) at ``compute``."""
        if not self.ok:
            raise ValueError(f"no prediction from a failed fit ({self.reason})")
        x = np.log(np.asarray(compute, float) / self.c_ref)
        s = np.full(x.shape, arm)
        t, _ = _terms(self.model, self.theta, x, s)
        return np.exp(np.logaddexp(self.theta[0], t))

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "status": self.status, "points": self.n_points}
        if self.ok:
            out.update(self.params(), c_ref=self.c_ref, huber_objective=self.objective)
            if self.note:
                out["note"] = self.note
        else:
            out["reason"] = self.reason
        return out


def _jacobian(model: str, x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The derivatives of each point's power-law term by the parameters that do not depend on them
    (the first column, ``e``'s, is zero); ``_terms`` fills the rest."""
    J = np.zeros((len(x), len(MODELS[model])))
    if model == "free":
        v = s.astype(float)
        J[:, 1], J[:, 2], J[:, 3], J[:, 4] = 1.0 - v, -(1.0 - v) * x, v, -v * x
    else:
        J[:, 1], J[:, 2] = 1.0, -x
    return J


def _terms(model: str, theta, x: np.ndarray, s: np.ndarray, J: Optional[np.ndarray] = None) -> tuple:
    """The power-law term ``t = log(A (k C)^-alpha)`` of each point and its derivatives (``J`` from
    ``_jacobian``, completed in place)."""
    if J is None:
        J = _jacobian(model, x, s)
    if model == "single":
        t = theta[1] - theta[2] * x
    elif model == "shared":
        shifted = x + s * theta[3]
        t = theta[1] - theta[2] * shifted
        J[:, 2], J[:, 3] = -shifted, -theta[2] * s
    else:
        t = np.where(s == 1, theta[3] - theta[4] * x, theta[1] - theta[2] * x)
    return t, J


def _objective(theta, model, x, s, y, w, delta, J):
    """Huber loss of the log residuals, divided by ``delta`` (``w`` sums to 1), and its gradient."""
    t, J = _terms(model, theta, x, s, J)
    pred = np.logaddexp(theta[0], t)
    share_e = np.exp(theta[0] - pred)
    r = pred - y
    a = np.abs(r)
    h = np.where(a <= delta, (0.5 / delta) * r * r, a - 0.5 * delta)
    g = w * np.clip(r * (1.0 / delta), -1.0, 1.0)
    grad = (g * (1.0 - share_e)) @ J
    grad[0] += g @ share_e
    return float(w @ h), grad


def _bounds(model: str, y: np.ndarray) -> list[tuple[float, float]]:
    lo, hi = float(y.min()), float(y.max())
    e = (lo - 10.0, hi)
    a = (lo - 15.0, hi + 5.0)
    if model == "single":
        return [e, a, ALPHA_BOUNDS]
    if model == "shared":
        return [e, a, ALPHA_BOUNDS, (-LOG_K_BOUND, LOG_K_BOUND)]
    return [e, a, ALPHA_BOUNDS, a, ALPHA_BOUNDS]


def _grid(model: str, x, s, y, w, bounds) -> list[np.ndarray]:
    """Starts: each (alpha, E) of the grid, with the amplitudes (and log k) that fit the points' mean."""
    loss = np.exp(y)
    starts = []
    for alpha in ALPHA_STARTS:
        for fraction in E_FRACTION_STARTS:
            e = math.log(fraction * loss.min())
            logr = np.log(loss - math.exp(e))

            def level(mask, shift=0.0):
                return float(np.average(logr[mask] + alpha * (x[mask] + shift), weights=w[mask]))

            base = s == 0
            if model == "single":
                theta = [e, level(np.ones_like(base)), alpha]
            elif model == "shared":
                a = level(base)
                logk = float(np.average((a - logr[~base]) / alpha - x[~base], weights=w[~base]))
                theta = [e, a, alpha, logk]
            else:
                theta = [e, level(base), alpha, level(~base), alpha]
            starts.append(np.clip(theta, [b[0] for b in bounds], [b[1] for b in bounds]))
    return starts


def _projected_gradient(theta, grad, bounds) -> float:
    g = np.array(grad, float)
    for j, (lo, hi) in enumerate(bounds):
        if (theta[j] <= lo and g[j] > 0) or (theta[j] >= hi and g[j] < 0):
            g[j] = 0.0
    return float(np.max(np.abs(g)))


PARAMETER_NAMES = {
    "single": ("log E", "log A", "alpha"),
    "shared": ("log E", "log A", "alpha", "log k"),
    "free": ("log E", "log A of the baseline", "alpha of the baseline", "log A of the variant", "alpha of the variant"),
}
BOUND_HINTS = {
    ("log E", "upper"): " (E reaches the largest loss)",
    ("log A", "lower"): " (no reducible loss: the loss does not fall with compute)",
}
# E at its lower bound (10 e-folds below the smallest loss) is the boundary E = 0 of a loss that cannot go
# below zero: the points show no saturation and follow a pure power law, ``L = A C^-alpha``. That is a fit
# (its predictions, k and exponents are those of the pure law; L-BFGS-B's projected gradient is zero
# there), noted rather than failed; young models far from their irreducible loss land here.
PURE_POWER_LAW = "E at its lower bound, about 0: no saturation in the measured range, a pure power law"


def _pure_power_law(theta, bounds) -> bool:
    lo, hi = bounds[0]
    return theta[0] - lo <= 1e-6 * (hi - lo)


def _at_bound(model: str, theta, bounds) -> Optional[str]:
    """Which parameter ended at its bound (the first; E's lower bound is a fit, see PURE_POWER_LAW), or None."""
    for j, (name, value, (lo, hi)) in enumerate(zip(PARAMETER_NAMES[model], theta, bounds)):
        tol = 1e-6 * (hi - lo)
        if j == 0 and _pure_power_law(theta, bounds):
            continue
        if value - lo <= tol or hi - value <= tol:
            side = "lower" if value - lo <= tol else "upper"
            hint = BOUND_HINTS.get((name.split(" of ")[0], side), "")
            return f"{name} at its {side} bound {lo if side == 'lower' else hi:.4g}{hint}"
    return None


def _check(model: str, points: Points) -> Optional[str]:
    """Why these points cannot determine the model, or None."""
    p = len(MODELS[model])
    c, L = points.compute, points.loss
    if not (np.all(np.isfinite(c)) and np.all(c > 0) and np.all(np.isfinite(L)) and np.all(L > 0)):
        return "degenerate data: compute and loss must be finite and positive"
    if not np.all(points.weight > 0):
        return "degenerate data: weights must be positive"
    if len(c) < p + 1:
        return f"too few points: {len(c)} for {p} parameters (need at least {p + 1})"
    arms = [0] if model == "single" else [0, 1]
    for arm in arms:
        mask = points.arm == arm if model != "single" else np.ones(len(c), bool)
        distinct = len(np.unique(c[mask]))
        need = 1 if (model == "shared" and arm == 1) else 2
        if distinct < need:
            who = ARMS[arm] if model != "single" else "the arm"
            return f"degenerate data: {who} has {distinct} distinct compute value(s), the model needs {need}"
    if np.ptp(np.log(L)) < 1e-12:
        return "degenerate data: the loss is the same at every point"
    return None


@single_threaded
def fit(
    points: Points,
    model: str = "shared",
    delta: float = HUBER_DELTA,
    starts: Optional[Iterable[np.ndarray]] = None,
    greedy: bool = False,
) -> Fit:
    """Fit ``model`` to ``points``: L-BFGS from every start (the grid, or ``starts``), the best kept; with
    ``greedy``, the first start that converges inside the bounds is kept (for bootstrap refits started
    at the full data's optimum, which moves little between replicates)."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; one of {', '.join(MODELS)}")
    points = points.sorted()
    problem = _check(model, points)
    if problem is not None:
        return Fit(model, "failed", problem, n_points=len(points.compute))
    c_ref = float(np.exp(np.mean(np.log(points.compute))))
    x, y, w, s = np.log(points.compute / c_ref), np.log(points.loss), points.weight, points.arm
    bounds = _bounds(model, y)
    lower, upper = [b[0] for b in bounds], [b[1] for b in bounds]
    if starts is None:
        starts = _grid(model, x, s, y, w, bounds)
    results = []
    for start in starts:
        res = minimize(
            _objective,
            np.clip(np.asarray(start, float), lower, upper),
            args=(model, x, s, y, w / w.sum(), delta, _jacobian(model, x, s)),
            jac=True,
            method="L-BFGS-B",
            bounds=bounds,
            options={"maxiter": 1000, "ftol": 1e-13, "gtol": 1e-9},
        )
        res.problem = _failure(model, res, bounds)
        results.append(res)
        if greedy and res.problem is None:
            break
    order = sorted(range(len(results)), key=lambda i: (results[i].fun, i))
    best = results[order[0]]
    alternatives = []
    for i in order[1:]:
        if len(alternatives) == 2:
            break
        if all(np.max(np.abs(results[i].x - t)) > 1e-3 for t in [best.x, *alternatives]):
            alternatives.append(results[i].x)
    common = dict(c_ref=c_ref, n_points=len(x))
    if best.problem is not None:
        return Fit(model, "failed", best.problem, **common)
    note = PURE_POWER_LAW if _pure_power_law(best.x, bounds) else ""
    return Fit(
        model, "ok", "", best.x, objective=float(best.fun), alternatives=tuple(alternatives), note=note, **common
    )


def _failure(model: str, res, bounds) -> Optional[str]:
    """Why an optimizer result is no fit (it stopped short, or a parameter sits at its bound), or None."""
    pg = _projected_gradient(res.x, res.jac, bounds)
    if not res.success and pg > 1e-6:
        return f"optimizer did not converge: {res.message} (projected gradient {pg:.2g})"
    return _at_bound(model, res.x, bounds)


def warm_starts(fitted: Fit) -> Optional[list[np.ndarray]]:
    """Starts for refitting resampled data: the fit's optimum and its next-best distinct optima."""
    return [fitted.theta, *fitted.alternatives] if fitted.ok else None


def free_multiplier(fitted: Fit, compute) -> np.ndarray:
    """From a ``free`` fit: how many times ``compute`` the baseline needs to reach the variant's loss at
    ``compute`` (the two arms share ``E``, so the baseline always gets there)."""
    e, a_b, al_b, a_v, al_v = fitted.theta
    x = np.log(np.asarray(compute, float) / fitted.c_ref)
    return np.exp((a_b - a_v + al_v * x) / al_b - x)


# -- the ladder --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """One training run of a ladder: its arm ("baseline" or "variant"), rung name, seed, training
    compute (FLOPs) and final validation loss (the metric fitted, e.g. bits per byte)."""

    arm: str
    rung: str
    seed: Any
    compute: float
    loss: float


def seed_order(seed: Any) -> tuple:
    """Seeds in numeric order where they are numbers, then by name."""
    text = str(seed)
    try:
        return (0, int(text), text)
    except ValueError:
        return (1, 0, text)


@dataclass(frozen=True)
class Cell:
    seeds: tuple
    losses: np.ndarray  # per seed, in seed order
    compute: float  # geometric mean of its runs' compute (the same for every seed of a well-formed ladder)

    @property
    def mean(self) -> float:
        return float(np.mean(self.losses))

    @property
    def spread(self) -> float:
        """Standard deviation over seeds (NaN with one seed)."""
        return float(np.std(self.losses, ddof=1)) if len(self.losses) > 1 else float("nan")


class Ladder:
    """Runs grouped into cells (arm x rung); rungs ordered by the baseline's compute."""

    def __init__(self, runs: Iterable[Run]):
        groups: dict[tuple[str, str], list[Run]] = {}
        for run in runs:
            if run.arm not in ARMS:
                raise ValueError(f"arm {run.arm!r} is neither baseline nor variant")
            groups.setdefault((run.arm, run.rung), []).append(run)
        self.cells: dict[tuple[str, str], Cell] = {}
        for key, group in groups.items():
            group = sorted(group, key=lambda r: seed_order(r.seed))
            seeds = tuple(r.seed for r in group)
            if len(set(map(str, seeds))) != len(seeds):
                raise ValueError(f"{key[0]} rung {key[1]}: a seed appears twice")
            compute = float(np.exp(np.mean(np.log([r.compute for r in group]))))
            self.cells[key] = Cell(seeds, np.array([r.loss for r in group], float), compute)

        def order(rung):
            cell = self.cells.get(("baseline", rung)) or self.cells[("variant", rung)]
            return (cell.compute, rung)

        self.rungs: tuple[str, ...] = tuple(sorted({rung for _, rung in self.cells}, key=order))

    def cell(self, arm: str, rung: str) -> Optional[Cell]:
        return self.cells.get((arm, rung))

    def keys(self) -> list[tuple[str, str]]:
        """The cells in canonical order: baseline rungs by compute, then the variant's."""
        return [(arm, rung) for arm in ARMS for rung in self.rungs if (arm, rung) in self.cells]

    def points(self, means: Optional[np.ndarray] = None) -> Points:
        """The cells as fit points (``means`` replaces the cell means, in ``keys()`` order)."""
        keys = self.keys()
        cells = [self.cells[k] for k in keys]
        loss = np.array([c.mean for c in cells]) if means is None else np.asarray(means, float)
        return Points(
            np.array([c.compute for c in cells]),
            loss,
            np.array([len(c.losses) for c in cells], float),
            np.array([ARMS.index(arm) for arm, _ in keys]),
        )

    def min_seeds(self) -> int:
        return min(len(c.losses) for c in self.cells.values())

    def paired(self, rung: str) -> bool:
        """Whether both arms ran the same seeds at ``rung`` (one seed draw then serves both)."""
        b, v = self.cell("baseline", rung), self.cell("variant", rung)
        return b is not None and v is not None and tuple(map(str, b.seeds)) == tuple(map(str, v.seeds))

    def runs(self) -> list[Run]:
        return [
            Run(arm, rung, seed, cell.compute, float(loss))
            for (arm, rung), cell in self.cells.items()
            for seed, loss in zip(cell.seeds, cell.losses)
        ]

    def without(self, rung: str) -> "Ladder":
        return Ladder(r for r in self.runs() if r.rung != rung)

    def aa(self) -> Optional["Ladder"]:
        """The A/A ladder: the baseline's seeds split in two halves (seed order) posing as two arms, or
        None where a baseline cell has fewer than two seeds."""
        runs = []
        for rung in self.rungs:
            cell = self.cell("baseline", rung)
            if cell is None:
                continue
            if len(cell.seeds) < 2:
                return None
            half = len(cell.seeds) // 2
            for i, (seed, loss) in enumerate(zip(cell.seeds, cell.losses)):
                runs.append(Run(ARMS[i >= half], rung, seed, cell.compute, float(loss)))
        return Ladder(runs)


class Resampler:
    """Bootstrap replicates of the cell means (``keys()`` order)."""

    def __init__(self, ladder: Ladder, shared_fit: Optional[Fit] = None, rng: Optional[np.random.Generator] = None):
        self.ladder = ladder
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.keys = ladder.keys()
        self.index = {k: i for i, k in enumerate(self.keys)}
        self.means = np.array([ladder.cells[k].mean for k in self.keys])
        self.df = 0  # degrees of freedom of the seed spread the replicates draw from
        self.rung_df: dict[str, int] = {}  # the same, rung by rung (seed resampling only)
        if ladder.min_seeds() >= 2:
            self.method = "seeds"
            for rung in ladder.rungs:
                cells = [ladder.cells[(a, rung)] for a in ARMS if (a, rung) in self.index]
                paired = ladder.paired(rung)
                self.rung_df[rung] = len(cells[0].losses) - 1 if paired else sum(len(c.losses) - 1 for c in cells)
            self.df = sum(self.rung_df.values())
        elif shared_fit is not None and shared_fit.ok:
            self.method = "residuals"
            pts = ladder.points()
            fitted = np.array([shared_fit.predict([c], a)[0] for c, a in zip(pts.compute, pts.arm)])
            self.log_fitted = np.log(fitted)
            resid = np.log(pts.loss) - self.log_fitted
            n, p = len(resid), len(MODELS["shared"])
            self.residuals = resid * math.sqrt(n / (n - p))
            self.df = n - p
        else:
            self.method = "none"

    def draw(self) -> np.ndarray:
        if self.method == "residuals":
            picks = self.rng.integers(0, len(self.residuals), len(self.residuals))
            return np.exp(self.log_fitted + self.residuals[picks])
        if self.method == "none":
            raise ValueError("no bootstrap: a cell has one seed and the shared fit failed")
        means = self.means.copy()
        for rung in self.ladder.rungs:
            arms = [a for a in ARMS if (a, rung) in self.index]
            shared_draw = None
            for arm in arms:
                cell = self.ladder.cells[(arm, rung)]
                n = len(cell.losses)
                if shared_draw is None or not self.ladder.paired(rung):
                    draw = self.rng.integers(0, n, n)
                    shared_draw = draw
                deviation = cell.losses[shared_draw] - cell.mean
                means[self.index[(arm, rung)]] = cell.mean + math.sqrt(n / (n - 1)) * deviation.mean()
        return means


# -- guards that run before any fit ------------------------------------------------------------------------
def min_replicates(confidence: float) -> int:
    """Bootstrap replicates a percentile interval at ``confidence`` needs: ``TAIL_REPLICATES`` beyond each
    end (100 at 90%, 200 at 95%, 1,000 at 99%); fewer leave an end resting on the extreme replicates."""
    return math.ceil(round(2 * TAIL_REPLICATES / (1.0 - confidence), 6))


def screen(ladder: Ladder) -> tuple[Ladder, list[dict[str, Any]]]:
    """The ladder without runs that look diverged, and those runs named. A run's reference is the median
    of its cell's other seeds, or (alone in its cell) the median of the same arm's next smaller rung,
    which a larger model trained on more tokens should not be above. The scale is the ladder's typical
    seed difference: the median over runs of the absolute log-loss difference from their cell's other
    seeds, robust to the few runs it screens. Divergence raises the loss, so only runs above their
    reference by more than ``DIVERGED_SPREADS`` scales (at least ``DIVERGED_FLOOR``) are screened."""
    deviations, refs = [], {}
    for (arm, rung), cell in ladder.cells.items():
        logs = np.log(cell.losses)
        for i, seed in enumerate(cell.seeds):
            others = np.delete(logs, i)
            if len(others):
                ref = float(np.median(others))
                deviations.append(abs(logs[i] - ref))
                refs[(arm, rung, str(seed))] = (ref, "the median of its cell's other seeds")
    for arm in ARMS:
        present = [r for r in ladder.rungs if ladder.cell(arm, r) is not None]
        for smaller, rung in zip(present, present[1:]):
            cell = ladder.cells[(arm, rung)]
            if len(cell.losses) == 1:
                ref = float(np.median(np.log(ladder.cells[(arm, smaller)].losses)))
                refs[(arm, rung, str(cell.seeds[0]))] = (ref, f"the {arm}'s mean at the smaller rung {smaller}")
    scale = float(np.median(deviations)) if deviations else 0.0
    threshold = max(DIVERGED_SPREADS * scale, DIVERGED_FLOOR)
    screened, kept = [], []
    for run in ladder.runs():
        ref = refs.get((run.arm, run.rung, str(run.seed)))
        if ref is not None and math.log(run.loss) - ref[0] > threshold:
            screened.append(
                {
                    "arm": run.arm,
                    "rung": run.rung,
                    "seed": run.seed,
                    "loss": run.loss,
                    "reference": math.exp(ref[0]),
                    "why": f"{run.loss:.4g} against {math.exp(ref[0]):.4g} for {ref[1]}, more than "
                    f"{math.expm1(threshold):.2%} above it ({DIVERGED_SPREADS:g} typical seed differences)",
                }
            )
        else:
            kept.append(run)
    return (Ladder(kept) if screened else ladder), screened


def seed_noise_delta(ladder: Ladder) -> tuple[float, str]:
    """Huber's delta for fits of this ladder's cell means, and how it was set: ``HUBER_EFFICIENCY`` times
    the standard error of a cell mean in log loss (the seeds' pooled within-cell standard deviation over
    the square root of the mean number of seeds per cell); ``HUBER_DELTA`` where no cell has two seeds."""
    sum_sq, df = 0.0, 0
    for cell in ladder.cells.values():
        if len(cell.losses) >= 2:
            logs = np.log(cell.losses)
            sum_sq += float(np.sum((logs - logs.mean()) ** 2))
            df += len(logs) - 1
    if df == 0:
        return HUBER_DELTA, f"the fallback {HUBER_DELTA:g}: no cell has two seeds to measure the noise by"
    sd = math.sqrt(sum_sq / df)
    per_cell = float(np.mean([len(c.losses) for c in ladder.cells.values()]))
    delta = max(HUBER_EFFICIENCY * sd / math.sqrt(per_cell), MIN_HUBER_DELTA)
    return delta, (
        f"{HUBER_EFFICIENCY:g} standard errors of a cell mean: seed sd {sd:.3g} in log loss ({df} degrees of "
        f"freedom), {per_cell:.3g} seeds per cell"
    )


def missing_cells(ladder: Ladder) -> list[tuple[str, str]]:
    """The (arm, rung) cells without a run, at rungs where the other arm has one."""
    return [(arm, rung) for rung in ladder.rungs for arm in ARMS if ladder.cell(arm, rung) is None]


# -- estimates with intervals ------------------------------------------------------------------------------
@dataclass
class Estimate:
    """A point estimate, its percentile interval and verdict (or why there is none)."""

    name: str
    estimate: Optional[float]
    lower: Optional[float] = None
    upper: Optional[float] = None
    status: str = "ok"
    reason: str = ""
    verdict: Optional[str] = None
    replicates: int = 0
    failed_replicates: int = 0
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        out = {
            "estimate": _finite(self.estimate),
            "interval": [_finite(self.lower), _finite(self.upper)],
            "status": self.status,
            "verdict": self.verdict,
            "replicates": self.replicates,
            "failed_replicates": self.failed_replicates,
        }
        if self.reason:
            out["reason"] = self.reason
        out.update(self.extra)
        return out


def _finite(v: Optional[float]) -> Optional[float]:
    """JSON has no infinity: a non-finite number is written as null (an unbounded end, or undefined)."""
    return float(v) if v is not None and math.isfinite(v) else None


def _verdict(lower: float, upper: float, null: float, positive: str, negative: str) -> str:
    if lower > null:
        return positive
    if upper < null:
        return negative
    return NO_DIFFERENCE


def t_widening(df: int, confidence: float) -> float:
    """How much wider a Student-t interval on ``df`` degrees of freedom is than a normal one: the
    factor the percentile interval is widened by, since the bootstrap takes a seed spread estimated
    from ``df`` degrees of freedom as known."""
    q = 1.0 - (1.0 - confidence) / 2.0
    return float(stdtrit(df, q) / ndtri(q)) if df >= 1 else float("nan")


def interval(values: np.ndarray, confidence: float, widen: float = 1.0) -> tuple[float, float]:
    """Percentile interval of the finite-or-infinite values (NaN dropped; each end rounds outwards),
    its half-widths about the replicates' median multiplied by ``widen``."""
    v = np.asarray(values, float)
    v = v[~np.isnan(v)]
    tail = (1.0 - confidence) / 2.0
    lo, hi = float(np.quantile(v, tail, method="lower")), float(np.quantile(v, 1.0 - tail, method="higher"))
    mid = float(np.median(v)) if np.all(np.isfinite(v)) else float(np.quantile(v, 0.5, method="nearest"))
    if widen != 1.0 and math.isfinite(mid):
        lo, hi = mid - widen * (mid - lo), mid + widen * (hi - mid)
    return lo, hi


def estimate(
    name: str,
    point: Optional[float],
    replicates: np.ndarray,
    confidence: float,
    null: float = 0.0,
    positive: str = VARIANT_BETTER,
    negative: str = BASELINE_BETTER,
    transform=None,
    failure: str = "",
    failures: Optional[Counter] = None,
    failed_what: str = "refits",
    widen: float = 1.0,
) -> Estimate:
    """An ``Estimate`` from a point value and its bootstrap replicates (NaN: a failed refit). ``transform``
    maps the value and its interval (e.g. ``exp`` for a log multiplier); ``null`` is on the mapped scale."""
    if point is None or (isinstance(point, float) and math.isnan(point)):
        return Estimate(name, None, status="failed", reason=failure or "no point estimate")
    f = transform or (lambda v: v)
    replicates = np.asarray(replicates, float)
    failed = int(np.sum(np.isnan(replicates)))
    n = len(replicates)
    result = Estimate(name, float(f(point)), replicates=n - failed, failed_replicates=failed)
    if n == 0:
        result.status, result.reason = "failed", "no bootstrap replicates"
        return result
    if failed > MAX_FAILED_REPLICATES * n:
        why = ""
        if failures:
            why = f"; most often: {failures.most_common(1)[0][0]}"
        result.status = "failed"
        result.reason = f"{failed} of {n} bootstrap {failed_what} did not converge{why}"
        if failed_what != "refits":
            result.reason = f"{failed} of {n} bootstrap {failed_what} undetermined (outside the baseline's range)"
        return result
    lo, hi = interval(replicates, confidence, widen)
    with np.errstate(over="ignore"):
        result.lower, result.upper = float(f(lo)), float(f(hi))
    result.verdict = _verdict(result.lower, result.upper, null, positive, negative)
    return result


def _exp(v: float) -> float:
    return math.exp(v) if v < 700 else float("inf")


# -- fit-free multipliers ---------------------------------------------------------------------------------
BEYOND, BELOW, NOT_MONOTONE = "beyond", "below", "not monotone"


def interpolated_multiplier(
    base_compute: np.ndarray, base_loss: np.ndarray, loss: float, compute: float
) -> tuple[float, str]:
    """The compute the baseline needs to reach ``loss`` (its mean losses interpolated piecewise-linearly
    in log compute against log loss), divided by ``compute``; ``(nan, why)`` outside its range:
    ``BEYOND`` (lower than the baseline's loss at its largest rung: +inf in a bootstrap), ``BELOW``
    (above the loss at its smallest rung: 0) or ``NOT_MONOTONE`` (its loss does not fall with compute)."""
    value, why, _ = _interpolate(base_compute, base_loss, loss, compute)
    return value, why


def _interpolate(base_compute, base_loss, loss: float, compute: float) -> tuple[float, str, tuple[int, ...]]:
    """``interpolated_multiplier`` and the baseline points it rests on (their indices)."""
    lc, ll, target = np.log(base_compute), np.log(base_loss), math.log(loss)
    if np.any(np.diff(ll) >= 0):
        return float("nan"), NOT_MONOTONE, tuple(range(len(ll)))
    if target < ll[-1]:
        return float("nan"), BEYOND, (len(ll) - 1,)
    if target > ll[0]:
        return float("nan"), BELOW, (0,)
    j = int(np.searchsorted(-ll, -target, side="right")) - 1
    j = min(max(j, 0), len(ll) - 2)
    frac = (ll[j] - target) / (ll[j] - ll[j + 1])
    return math.exp(lc[j] + frac * (lc[j + 1] - lc[j])) / compute, "", (j, j + 1)


def _as_replicate(value: float, why: str, bound: float) -> float:
    """A replicate's log multiplier for the interval: outside the baseline's range it is only known to
    be above (``BEYOND``) or below (``BELOW``) ``bound``, which settles its side of 1 (+inf or -inf)
    only when the bound is on that side; otherwise it is undetermined (NaN)."""
    if why == BEYOND:
        return float("inf") if bound >= 1.0 else float("nan")
    if why == BELOW:
        return -float("inf") if bound <= 1.0 else float("nan")
    return math.log(value)


def _rung_multipliers(ladder: Ladder, means: np.ndarray, involved: Optional[list] = None) -> tuple[list, list]:
    """The fit-free multiplier at each rung, and why where there is none; ``involved`` collects, per rung,
    the rungs whose cells it rests on (its own and the baseline's it interpolates between)."""
    keys = ladder.keys()
    index = {k: i for i, k in enumerate(keys)}
    base = [r for r in ladder.rungs if ("baseline", r) in index]
    bc = np.array([ladder.cells[("baseline", r)].compute for r in base])
    bl = np.array([means[index[("baseline", r)]] for r in base])
    values, whys = [], []
    for rung in ladder.rungs:
        if ("variant", rung) not in index or len(base) < 2:
            values.append(float("nan"))
            whys.append("no variant at this rung" if len(base) >= 2 else "fewer than two baseline rungs")
            if involved is not None:
                involved.append({rung})
            continue
        v, why, used = _interpolate(bc, bl, means[index[("variant", rung)]], ladder.cells[("variant", rung)].compute)
        values.append(v)
        whys.append(why)
        if involved is not None:
            involved.append({rung, *(base[i] for i in used)})
    return values, whys


def _range_bounds(ladder: Ladder) -> list[float]:
    """Per rung, what an out-of-range multiplier is known to exceed (``BEYOND``: the baseline's largest
    compute over the variant's) or stay under (``BELOW``: its smallest compute over the variant's)."""
    base = [ladder.cell("baseline", r).compute for r in ladder.rungs if ladder.cell("baseline", r) is not None]
    out = []
    for rung in ladder.rungs:
        v = ladder.cell("variant", rung)
        out.append((max(base) / v.compute, min(base) / v.compute) if v is not None and base else (math.nan, math.nan))
    return out


_WHY = {
    BEYOND: "the variant's loss is below the baseline's at its largest rung: the baseline would need more "
    "compute than measured",
    BELOW: "the variant's loss is above the baseline's at its smallest rung: the baseline would need less "
    "compute than measured",
    NOT_MONOTONE: "the baseline's mean loss does not fall monotonically with compute",
}


# -- the whole comparison ---------------------------------------------------------------------------------
@dataclass
class Comparison:
    """Everything ``compare`` measures; ``summary()`` is what ``fits.json`` holds."""

    ladder: Ladder
    confidence: float
    bootstrap: int
    method: str
    shared: Fit
    free: Fit
    single: dict[str, Fit]
    k: Estimate
    exponent_difference: Estimate
    rung_multipliers: list[dict]
    rollout: dict
    aa: dict
    extrapolations: list[dict]
    curves: dict  # compute grid and bootstrap bands, for the figures
    degrees_of_freedom: int = 0
    t_widening: float = 1.0
    huber_delta: float = HUBER_DELTA
    huber_delta_note: str = ""
    screened: list = field(default_factory=list)  # runs left out as diverged, each with why
    guards: dict = field(default_factory=dict)  # each guard on the fitted verdicts: passed, or why not
    measured: Optional[Ladder] = None  # the ladder before the screen (the figures show every run)

    def summary(self) -> dict[str, Any]:
        return {
            "confidence": self.confidence,
            "bootstrap": self.bootstrap,
            "bootstrap_method": self.method,
            "degrees_of_freedom": self.degrees_of_freedom,
            "t_widening": self.t_widening,
            "huber_delta": self.huber_delta,
            "huber_delta_note": self.huber_delta_note,
            "screened": self.screened,
            "guards": self.guards,
            "paired_rungs": [r for r in self.ladder.rungs if self.ladder.paired(r)],
            "fits": {
                "shared": self.shared.summary(),
                "free": self.free.summary(),
                **{f"single_{arm}": f.summary() for arm, f in self.single.items()},
            },
            "k": self.k.summary(),
            "exponent_difference": self.exponent_difference.summary(),
            "rung_multipliers": self.rung_multipliers,
            "rollout": self.rollout,
            "aa": self.aa,
            "extrapolations": self.extrapolations,
        }


def _arm_points(ladder: Ladder, arm: str) -> Points:
    pts = ladder.points()
    mask = pts.arm == ARMS.index(arm)
    return Points(pts.compute[mask], pts.loss[mask], pts.weight[mask], np.zeros(int(mask.sum()), int))


def largest_compute(ladder: Ladder) -> float:
    """The baseline's compute at the largest rung (the reference of the extrapolation factors)."""
    cell = ladder.cell("baseline", ladder.rungs[-1]) or ladder.cell("variant", ladder.rungs[-1])
    return cell.compute


def _k_interval(
    ladder: Ladder,
    shared: Fit,
    n_boot: int,
    confidence: float,
    rng,
    calibrate: bool = True,
    delta: float = HUBER_DELTA,
) -> tuple[Estimate, Resampler]:
    """k with its bootstrap interval (the shared fit refitted on each replicate), and the resampler."""
    sampler = Resampler(ladder, shared, rng)
    if not shared.ok:
        return Estimate("k", None, status="failed", reason=f"shared fit: {shared.reason}"), sampler
    widen = t_widening(sampler.df, confidence) if calibrate else 1.0
    values, failures = np.full(n_boot, np.nan), Counter()
    starts = warm_starts(shared)
    for b in range(n_boot):
        f = fit(ladder.points(sampler.draw()), "shared", delta=delta, starts=starts, greedy=True)
        if f.ok:
            values[b] = f.theta[3]
        else:
            failures[f.reason.split(" (")[0]] += 1
    k = estimate("k", shared.theta[3], values, confidence, 1.0, transform=_exp, failures=failures, widen=widen)
    k.extra = {"t_widening": widen}
    return k, sampler


def _check_replicates(n_boot: int, confidence: float) -> None:
    if n_boot < min_replicates(confidence):
        raise ValueError(
            f"a {confidence:.0%} interval needs at least {min_replicates(confidence)} bootstrap replicates "
            f"({TAIL_REPLICATES} beyond each end), got {n_boot}"
        )


@single_threaded
def multiplier_interval(
    ladder: Ladder, n_boot: int = 1000, confidence: float = 0.9, seed: int = 0, calibrate: bool = True
) -> Estimate:
    """Only ``k`` and its interval (what coverage studies draw many times), with the Huber delta ``compare``
    would use."""
    _check_replicates(n_boot, confidence)
    rng = np.random.default_rng(seed)
    delta, _ = seed_noise_delta(ladder)
    shared = fit(ladder.points(), "shared", delta=delta)
    return _k_interval(ladder, shared, n_boot, confidence, rng, calibrate, delta)[0]


def _band(values: np.ndarray, confidence: float, widen: float) -> np.ndarray:
    """Pointwise ``interval`` of replicate curves (first axis: replicates): ``[lower, upper]``."""
    tail = (1.0 - confidence) / 2.0
    lo, mid, hi = np.nanquantile(values, [tail, 0.5, 1.0 - tail], axis=0)
    return np.array([mid - widen * (mid - lo), mid + widen * (hi - mid)])


@dataclass
class _Holdout:
    """One rollout fit: the rungs below ``held`` (both arms), fitted and predicting ``held``."""

    held: str
    rest: Ladder
    rows: list  # the rest's cells as rows of the whole ladder's keys()
    fits: dict  # model -> Fit


def rollout_holdouts(ladder: Ladder, delta: float) -> tuple[dict[str, Optional[str]], dict[str, _Holdout]]:
    """Per arm, the largest rung it has (None: it has no runs); per such rung, the fits of the rungs below
    it. With a complete ladder both arms hold out the same rung and one fit serves both."""
    keys = ladder.keys()
    held_by_arm: dict[str, Optional[str]] = {}
    holdouts: dict[str, _Holdout] = {}
    for arm in ARMS:
        present = [r for r in ladder.rungs if ladder.cell(arm, r) is not None]
        held_by_arm[arm] = present[-1] if present else None
        if present and present[-1] not in holdouts:
            below = set(ladder.rungs[: ladder.rungs.index(present[-1])])
            rest = Ladder(r for r in ladder.runs() if r.rung in below)
            fits = {m: fit(rest.points(), m, delta=delta) for m in ("shared", "free")}
            holdouts[present[-1]] = _Holdout(present[-1], rest, [keys.index(k) for k in rest.keys()], fits)
    return held_by_arm, holdouts


def rollout_check(
    ladder: Ladder,
    held_by_arm: dict[str, Optional[str]],
    holdouts: dict[str, _Holdout],
    errors: dict[tuple[str, str], np.ndarray],
    widen: float,
    why_no_bootstrap: Optional[str],
) -> dict[str, Any]:
    """Each arm's largest rung predicted by each two-arm fit of the rungs below it, against its seeds.
    ``errors[(model, arm)]`` are the bootstrap's errors (resampled seeds, refitted smaller rungs, against
    the resampled held-out mean). Per model: a ``reason`` per arm where the check could not run, and
    ``misses`` (True: an arm's ``ROLLOUT_CONFIDENCE`` interval excludes zero; False: every arm's covers it;
    None: an arm could not be checked, which withholds the verdict as a miss does)."""
    out: dict[str, Any] = {"confidence": ROLLOUT_CONFIDENCE, "held_out": dict(held_by_arm)}
    for model in ("shared", "free"):
        entry: dict[str, Any] = {}
        misses: Optional[bool] = False
        for arm in ARMS:
            held = held_by_arm[arm]
            if held is None:
                entry[arm] = {"reason": f"the {arm} has no runs"}
                misses = None if misses is False else misses
                continue
            f = holdouts[held].fits[model]
            cell = ladder.cells[(arm, held)]
            if not f.ok:
                row: dict[str, Any] = {"held_out_rung": held, "reason": f"the fit below {held} failed: {f.reason}"}
                entry[arm] = row
                misses = None if misses is False else misses
                continue
            pred = float(f.predict([cell.compute], ARMS.index(arm))[0])
            row = {
                "held_out_rung": held,
                "predicted": pred,
                "observed": cell.mean,
                "error": pred - cell.mean,
                "seed_spread": _finite(cell.spread),
                "error_in_spreads": _finite(abs(pred - cell.mean) / cell.spread) if cell.spread > 0 else None,
            }
            values = errors.get((model, arm))
            if why_no_bootstrap is not None:
                row["reason"] = why_no_bootstrap
            elif values is None or np.mean(np.isnan(values)) > MAX_FAILED_REPLICATES:
                failed = int(np.sum(np.isnan(values))) if values is not None else 0
                row["reason"] = f"{failed} of {len(values) if values is not None else 0} bootstrap refits failed"
            else:
                lo, hi = interval(values, ROLLOUT_CONFIDENCE, widen)
                row["error_interval"] = [lo, hi]
                row["misses"] = not lo <= 0.0 <= hi
            if "reason" in row:
                misses = None if misses is False else misses
            elif row["misses"]:
                misses = True
            entry[arm] = row
        entry["misses"] = misses
        out[model] = entry
    return out


def rollout_miss(rollout: dict[str, Any], model: str) -> Optional[str]:
    """Why no sign may be called from ``model``'s fit: it misses its rollout check, or the check could not
    run for an arm; else None."""
    entry = rollout.get(model, {})
    if entry.get("misses") is True:
        errors = ", ".join(
            "{} at {} {:+.3g} [{:+.3g}, {:+.3g}]".format(
                arm, entry[arm]["held_out_rung"], entry[arm]["error"], *entry[arm]["error_interval"]
            )
            for arm in ARMS
            if entry.get(arm, {}).get("misses")
        )
        return (
            f"the {model} fit of the smaller rungs misses the held-out largest rung ({errors} at "
            f"{rollout['confidence']:.0%}): its form does not hold across these rungs"
        )
    if entry.get("misses") is None:
        why = "; ".join(f"{arm}: {entry[arm]['reason']}" for arm in ARMS if "reason" in entry.get(arm, {}))
        return f"the rollout check of the {model} fit could not run ({why})"
    return None


def withhold_verdict(e: Estimate | dict, why: Optional[str]) -> Estimate | dict:
    """Keep ``e``'s numbers but call no sign from them, saying why (a guard that failed or could not run).
    ``e`` is an Estimate or its ``summary()``."""
    verdict = e.get("verdict") if isinstance(e, dict) else e.verdict
    if not why or not verdict:
        return e
    text = f"{verdict} by its interval, not called: {why}"
    if isinstance(e, dict):
        e["verdict"], e["verdict_withheld"] = None, text
    else:
        e.verdict, e.extra["verdict_withheld"] = None, text
    return e


AA_MISS = (
    "the A/A null's {level:.0%} k interval excludes 1, so the intervals are narrower than this ladder's "
    "seed-to-seed differences (a seed's luck repeating at every rung, which the per-rung resampling does not see)"
)


def _aa_guard(aa: dict[str, Any]) -> Optional[str]:
    """Why the A/A null withholds fitted verdicts: it excludes 1, or it did not run; else None."""
    if aa.get("covers_1") is True:
        return None
    if aa.get("covers_1") is False:
        return AA_MISS.format(level=AA_CONFIDENCE)
    return f"no A/A null to check the intervals against ({aa.get('reason') or aa['k'].get('reason', 'failed')})"


def verdict_guards(screened: list[dict], missing: list[tuple[str, str]], aa: dict, rollout: dict) -> dict[str, Any]:
    """Every guard on the fitted verdicts: ``passed`` and, where not, ``reason``."""

    def entry(reason: Optional[str]) -> dict[str, Any]:
        return {"passed": True} if reason is None else {"passed": False, "reason": reason}

    names = "; ".join(f"{r['arm']} {r['rung']} seed {r['seed']} ({r['why']})" for r in screened)
    absent = ", ".join(f"{arm} at {rung}" for arm, rung in missing)
    return {
        "screen": entry(f"runs that look diverged, left out of every fit (rerun them): {names}" if screened else None),
        "complete": entry(f"the ladder is incomplete, no run of the {absent}" if missing else None),
        "aa": entry(_aa_guard(aa)),
        "rollout_shared": entry(rollout_miss(rollout, "shared")),
        "rollout_free": entry(rollout_miss(rollout, "free")),
    }


def withheld_because(guards: dict[str, Any], model: str) -> Optional[str]:
    """Why a statistic of ``model``'s fit calls no sign: every failed guard that concerns it."""
    names = ("screen", "complete", "aa", f"rollout_{model}")
    reasons = [guards[n]["reason"] for n in names if not guards[n]["passed"]]
    return "; ".join(reasons) or None


@single_threaded
def compare(
    ladder: Ladder,
    confidence: float = 0.9,
    n_boot: int = 1000,
    targets: Sequence[float] = (),
    seed: int = 0,
    calibrate: bool = True,
) -> Comparison:
    """Screen out diverged runs, fit both arms, bootstrap every statistic, run the rollout check and the
    A/A null, extrapolate to 10x and 100x the largest rung's compute and to each of ``targets`` (FLOPs).
    With ``calibrate``, every percentile interval is widened by ``t_widening`` of the seed degrees of
    freedom. A fitted statistic names a sign only where every guard passed (``guards`` in the summary):
    no run screened, no cell missing, the A/A null run and covering 1, and the rollout check run for
    both arms and passed; a guard that could not run withholds as one that failed."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    _check_replicates(n_boot, confidence)
    measured = ladder
    ladder, screened = screen(ladder)
    delta, delta_note = seed_noise_delta(ladder)
    rng = np.random.default_rng(seed)
    points = ladder.points()
    shared, free = fit(points, "shared", delta=delta), fit(points, "free", delta=delta)
    single = {arm: fit(_arm_points(ladder, arm), "single", delta=delta) for arm in ARMS}
    c_max = largest_compute(ladder)
    target_list = [(10.0 * c_max, "10x largest"), (100.0 * c_max, "100x largest")]
    target_list += [(float(t), "target") for t in targets]
    c_min = min(c.compute for c in ladder.cells.values())
    grid = np.geomspace(c_min / 1.5, max(t for t, _ in target_list), 80)

    sampler = Resampler(ladder, shared, rng)
    widen = t_widening(sampler.df, confidence) if calibrate and sampler.method != "none" else 1.0
    involved: list[set] = []
    rung_values, rung_whys = _rung_multipliers(ladder, points.loss, involved)
    bounds = _range_bounds(ladder)
    T = len(target_list)
    rep = {
        "logk": np.full(n_boot, np.nan),
        "dalpha": np.full(n_boot, np.nan),
        "rung": np.full((n_boot, len(ladder.rungs)), np.nan),
        "gap_shared": np.full((n_boot, T), np.nan),
        "gap_free": np.full((n_boot, T), np.nan),
        "mult_free": np.full((n_boot, T), np.nan),
        "curve": np.full((n_boot, 2, len(grid)), np.nan),
        "curve_mult": np.full((n_boot, len(grid)), np.nan),
    }
    fail_shared, fail_free = Counter(), Counter()
    tc = np.array([t for t, _ in target_list])
    keys = ladder.keys()
    held_by_arm, holdouts = rollout_holdouts(ladder, delta)
    # the rollout's 99% interval: with too few replicates for it the check does not run (and withholds)
    why_no_rollout = None
    if sampler.method == "none":
        why_no_rollout = "no bootstrap: a cell has one seed and the shared fit failed"
    elif n_boot < min_replicates(ROLLOUT_CONFIDENCE):
        why_no_rollout = (
            f"its {ROLLOUT_CONFIDENCE:.0%} interval needs at least {min_replicates(ROLLOUT_CONFIDENCE)} bootstrap "
            f"replicates, got {n_boot}"
        )
    rollout_errors: dict[tuple[str, str], np.ndarray] = {}
    if why_no_rollout is None:
        for arm, held in held_by_arm.items():
            for m in ("shared", "free"):
                if held is not None and holdouts[held].fits[m].ok:
                    rollout_errors[(m, arm)] = np.full(n_boot, np.nan)
    rollout_starts = {(h, m): warm_starts(o.fits[m]) for h, o in holdouts.items() for m in ("shared", "free")}
    if sampler.method != "none":
        s_starts, f_starts = warm_starts(shared), warm_starts(free)
        for b in range(n_boot):
            means = sampler.draw()
            pts = ladder.points(means)
            if rollout_errors:
                for held, o in holdouts.items():
                    for m in ("shared", "free"):
                        arms = [a for a in ARMS if held_by_arm[a] == held and (m, a) in rollout_errors]
                        if not arms:
                            continue
                        fr = fit(
                            o.rest.points(means[o.rows]), m, delta=delta, starts=rollout_starts[(held, m)], greedy=True
                        )
                        if fr.ok:
                            for a in arms:
                                i = keys.index((a, held))
                                pred = fr.predict([ladder.cells[(a, held)].compute], ARMS.index(a))[0]
                                rollout_errors[(m, a)][b] = pred - means[i]
            fs = fit(pts, "shared", delta=delta, starts=s_starts, greedy=True)
            if fs.ok:
                rep["logk"][b] = fs.theta[3]
                rep["gap_shared"][b] = fs.predict(tc, 0) - fs.predict(tc, 1)
                rep["curve"][b] = [fs.predict(grid, 0), fs.predict(grid, 1)]
            else:
                fail_shared[fs.reason.split(" (")[0]] += 1
            ff = fit(pts, "free", delta=delta, starts=f_starts, greedy=True)
            if ff.ok:
                rep["dalpha"][b] = ff.theta[4] - ff.theta[2]
                rep["gap_free"][b] = ff.predict(tc, 0) - ff.predict(tc, 1)
                rep["mult_free"][b] = np.log(free_multiplier(ff, tc))
                rep["curve_mult"][b] = np.log(free_multiplier(ff, grid))
            else:
                fail_free[ff.reason.split(" (")[0]] += 1
            values, whys = _rung_multipliers(ladder, means)
            rep["rung"][b] = [
                _as_replicate(v, w, bounds[j][0] if w == BEYOND else bounds[j][1])
                for j, (v, w) in enumerate(zip(values, whys))
            ]

    def est(name, point, values, fitted: Fit, failures, **kw):
        if not fitted.ok:
            return Estimate(name, None, status="failed", reason=f"{fitted.model} fit: {fitted.reason}")
        if sampler.method == "none":
            return Estimate(name, point, status="failed", reason="no bootstrap: a cell has one seed")
        return estimate(name, point, values, confidence, failures=failures, widen=widen, **kw)

    rollout = rollout_check(ladder, held_by_arm, holdouts, rollout_errors, widen, why_no_rollout)
    k = est("k", shared.theta[3] if shared.ok else None, rep["logk"], shared, fail_shared, null=1.0, transform=_exp)
    dalpha = est(
        "exponent_difference",
        float(free.theta[4] - free.theta[2]) if free.ok else None,
        rep["dalpha"],
        free,
        fail_free,
        positive="variant steeper",
        negative="baseline steeper",
    )
    if free.ok:
        dalpha.extra.update(alpha_baseline=float(free.theta[2]), alpha_variant=float(free.theta[4]))

    rung_rows = []
    for j, rung in enumerate(ladder.rungs):
        b, v = ladder.cell("baseline", rung), ladder.cell("variant", rung)
        row: dict[str, Any] = {"rung": rung}
        if b is not None and v is not None:
            row["gap"] = b.mean - v.mean
        point = rung_values[j]
        # a rung's multiplier rests on two or three cells' seeds, not on the whole ladder's
        rung_widen = widen
        if calibrate and sampler.method == "seeds":
            rung_widen = t_widening(sum(sampler.rung_df[r] for r in involved[j]), confidence)
        if math.isnan(point):
            e = Estimate("multiplier", None, status="failed", reason=_WHY.get(rung_whys[j], rung_whys[j]))
            values = rep["rung"][:, j]
            undetermined = int(np.sum(np.isnan(values)))
            if rung_whys[j] in (BEYOND, BELOW) and sampler.method != "none" and undetermined <= 0.1 * n_boot:
                lo, hi = interval(values, confidence, rung_widen)
                e.lower, e.upper = _exp(lo), _exp(hi)
                e.verdict = _verdict(e.lower, e.upper, 1.0, VARIANT_BETTER, BASELINE_BETTER)
                e.replicates, e.failed_replicates = n_boot - undetermined, undetermined
            if rung_whys[j] == BEYOND:
                e.extra["at_least"] = bounds[j][0]
            elif rung_whys[j] == BELOW:
                e.extra["at_most"] = bounds[j][1]
        elif sampler.method == "none":
            e = Estimate("multiplier", point, status="failed", reason="no bootstrap: a cell has one seed")
        else:
            e = estimate(
                "multiplier",
                math.log(point),
                rep["rung"][:, j],
                confidence,
                null=1.0,
                transform=_exp,
                failed_what="multipliers",
                widen=rung_widen,
            )
            e.extra["replicates_outside_range"] = int(np.sum(np.isinf(rep["rung"][:, j])))
        e.extra["t_widening"] = rung_widen
        row.update(e.summary())
        if v is not None:
            row["variant_compute"] = v.compute
        rung_rows.append(row)

    extrapolations = []
    for t, (c, label) in enumerate(target_list):
        row = {"label": label, "compute": c, "factor": c / c_max}
        if shared.ok:
            row["loss_baseline_shared"] = float(shared.predict([c], 0)[0])
            row["loss_variant_shared"] = float(shared.predict([c], 1)[0])
        gap_s = row["loss_baseline_shared"] - row["loss_variant_shared"] if shared.ok else None
        row["gap_shared"] = est("gap", gap_s, rep["gap_shared"][:, t], shared, fail_shared).summary()
        gap_f = float(free.predict([c], 0)[0] - free.predict([c], 1)[0]) if free.ok else None
        row["gap_free"] = est("gap", gap_f, rep["gap_free"][:, t], free, fail_free).summary()
        log_m = float(np.log(free_multiplier(free, [c])[0])) if free.ok else None
        row["multiplier_free"] = est(
            "multiplier", log_m, rep["mult_free"][:, t], free, fail_free, null=1.0, transform=_exp
        ).summary()
        extrapolations.append(row)

    aa_ladder = ladder.aa()
    if aa_ladder is None:
        aa: dict[str, Any] = {"status": "failed", "reason": "a baseline cell has fewer than two seeds"}
    elif n_boot < min_replicates(AA_CONFIDENCE):
        aa = {
            "status": "failed",
            "reason": f"its {AA_CONFIDENCE:.0%} interval needs at least {min_replicates(AA_CONFIDENCE)} bootstrap "
            f"replicates, got {n_boot}",
        }
    else:
        aa_shared = fit(aa_ladder.points(), "shared", delta=delta)
        aa_k, aa_sampler = _k_interval(aa_ladder, aa_shared, n_boot, AA_CONFIDENCE, rng, calibrate, delta)
        aa = {"k": aa_k.summary(), "bootstrap_method": aa_sampler.method, "degrees_of_freedom": aa_sampler.df}
        if aa_k.status == "ok":
            aa["covers_1"] = bool(aa_k.lower <= 1.0 <= aa_k.upper)
    aa["confidence"] = AA_CONFIDENCE

    guards = verdict_guards(screened, missing_cells(ladder), aa, rollout)
    why_shared, why_free = withheld_because(guards, "shared"), withheld_because(guards, "free")
    withhold_verdict(k, why_shared)
    withhold_verdict(dalpha, why_free)
    for row in extrapolations:
        row["multiplier_shared"] = k.summary()
        withhold_verdict(row["gap_shared"], why_shared)
        withhold_verdict(row["gap_free"], why_free)
        withhold_verdict(row["multiplier_free"], why_free)

    curves = {"compute": grid, "c_max": c_max, "targets": target_list}
    if np.any(~np.isnan(rep["curve"][:, 0, 0])):
        curves["band"] = _band(rep["curve"], confidence, widen)
    if np.any(~np.isnan(rep["curve_mult"][:, 0])):
        curves["mult_band"] = np.exp(_band(rep["curve_mult"], confidence, widen))
    return Comparison(
        ladder,
        confidence,
        n_boot,
        sampler.method,
        shared,
        free,
        single,
        k,
        dalpha,
        rung_rows,
        rollout,
        aa,
        extrapolations,
        curves,
        sampler.df,
        widen,
        huber_delta=delta,
        huber_delta_note=delta_note,
        screened=screened,
        guards=guards,
        measured=measured,
    )
