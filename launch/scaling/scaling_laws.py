r"""The three Chinchilla approaches to compute-optimal scaling, with bootstrap intervals.

Notation: N parameters (the sweep uses non-embedding ones), D training tokens, C
training FLOPs, L the final evaluation loss. Each approach estimates how the
compute-optimal N and D grow with C, N_opt = G_N·C^a and D_opt = G_D·C^b, and
answers "which N and D for this budget?" (Hoffmann et al. 2022, section 3):

1. Lower envelope (`fit_envelope`). Every training curve is put on a common log-spaced
   grid of compute; at each grid value the run with the lowest loss is the optimum for
   that compute. Power laws log N_opt = log G_N + a·log C (and for D) are fitted by
   least squares to the envelope points, leaving out points won by the smallest or
   largest model (their optimum may lie beyond the sizes trained). Runs given only by their final loss are
   curves of one point: the envelope is then the Pareto frontier of the final losses.
2. IsoFLOP profiles (`fit_isoflop`). For each budget, a parabola of the loss in log N
   through that budget's runs; its vertex is the budget's optimal N, and D_opt = C /
   (k·N_opt) with k = C/(N·D) of that budget's runs (6 for the 6ND rule). Power laws in
   C are fitted to the vertices. The parabola is biased when the profile is lopsided
   about the sampled sizes, so a budget whose vertex falls outside its sampled sizes
   (the optimum was not bracketed) or whose parabola opens downwards is left out of
   the power law and reported as such, and resampling is stratified by budget.
3. Parametric fit (`fit_parametric`). L(N, D) = E + A/N^α + B/D^β, written as
   log L = LSE(a - α·log N, b - β·log D, e) with A = e^a, B = e^b, E = e^e, fitted by
   minimising the Huber loss (δ = 10⁻³) of the log-loss residuals with L-BFGS from the
   best few of a grid of 4,500 starting points (the grid of Hoffmann et al.; Besiroglu et
   al. 2024 show that a single start and no intervals mislead). The compute-optimal
   frontier follows in closed form for C = k·N·D: N_opt = G·(C/k)^a with
   G = (αA / βB)^(1/(α+β)), a = β/(α+β), b = α/(α+β), D_opt = (C/k)/N_opt.

Intervals: percentile bootstrap (95% by default) over runs resampled with replacement
(whole curves for approach 1, runs within each budget for approach 2, runs for
approach 3); every replicate refits the approach from scratch on its resample, so the
intervals include the instability of the fit itself. Replicates that cannot be fitted
(e.g. a resample with fewer than 3 distinct sizes in a budget) are dropped and counted.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from scipy import optimize

HUBER_DELTA = 1e-3
DEFAULT_CONFIDENCE = 0.95
ENVELOPE_GRID_POINTS = 60
# Starting points of the parametric fit: the grid of Hoffmann et al. (appendix D.2).
_GRID_EXPONENTS = np.arange(0.0, 2.01, 0.5)
_GRID_LOG_E = np.arange(-1.0, 1.01, 0.5)
_GRID_LOG_AB = np.arange(0.0, 25.01, 5.0)
_STARTS = 8


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A fitted quantity, its bootstrap interval and the replicates that produced it."""
  value: float
  low: float
  high: float

  def covers(self, truth: float) -> bool:
    return self.low <= truth <= self.high

  def to_json(self) -> Dict[str, float]:
    return {"value": self.value, "low": self.low, "high": self.high}


@dataclasses.dataclass(frozen=True)
class Runs:
  """Final results of a set of runs (arrays of equal length), plus optional curves.

  `curves[i]` is run i's evaluation curve as (tokens, loss) arrays, its last point at
  (tokens[i], loss[i]); None means only the final loss is known.
  """
  params: np.ndarray
  tokens: np.ndarray
  loss: np.ndarray
  flops: np.ndarray
  budget: np.ndarray            # the run's nominal FLOP budget (isoFLOP group)
  curves: Optional[List[Tuple[np.ndarray, np.ndarray]]] = None

  def __post_init__(self):
    n = len(self.params)
    for name in ("tokens", "loss", "flops", "budget"):
      if len(getattr(self, name)) != n:
        raise ValueError(f"runs: column {name} has {len(getattr(self, name))} values, "
                         f"params has {n}")
    for name in ("params", "tokens", "loss", "flops"):
      values = getattr(self, name)
      if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(f"runs: every {name} must be positive and finite")

  @classmethod
  def from_columns(cls, params, tokens, loss, flops=None, budget=None,
                   curves=None) -> "Runs":
    params = np.asarray(params, np.float64)
    tokens = np.asarray(tokens, np.float64)
    flops = 6.0 * params * tokens if flops is None else np.asarray(flops, np.float64)
    budget = group_budgets(flops) if budget is None else np.asarray(budget, np.float64)
    return cls(params, tokens, np.asarray(loss, np.float64), flops, budget, curves)

  @property
  def flops_per_param_token(self) -> float:
    """k in C = k·N·D (6 under the 6ND rule), the median over the runs."""
    return float(np.median(self.flops / (self.params * self.tokens)))


def group_budgets(flops: np.ndarray, tolerance: float = 0.1) -> np.ndarray:
  """Each run's isoFLOP budget: runs within `tolerance` (relative) of their neighbours
  in sorted compute share one, the geometric mean of the group."""
  flops = np.asarray(flops, np.float64)
  order = np.argsort(flops)
  log_c = np.log(flops[order])
  starts = np.concatenate([[True], np.diff(log_c) > math.log1p(tolerance)])
  group = np.cumsum(starts) - 1
  budget = np.empty_like(flops)
  for g in np.unique(group):
    budget[order[group == g]] = math.exp(log_c[group == g].mean())
  return budget


def _interval(values: np.ndarray, point: float, confidence: float) -> Estimate:
  values = values[np.isfinite(values)]
  if len(values) < 2:
    return Estimate(float(point), math.nan, math.nan)
  tail = 100 * (1 - confidence) / 2
  low, high = np.percentile(values, [tail, 100 - tail])
  return Estimate(float(point), float(low), float(high))


def _power_law(log_c: np.ndarray, log_y: np.ndarray, mask: np.ndarray
               ) -> Tuple[np.ndarray, np.ndarray]:
  """Batched least-squares lines log_y = intercept + slope·log_c over masked points.

  Arrays are [batch, points]; rows with fewer than 2 distinct masked x give NaN.
  """
  w = mask.astype(np.float64)
  count = w.sum(-1)
  with np.errstate(invalid="ignore", divide="ignore"):
    mean_x = (w * log_c).sum(-1) / count
    mean_y = (w * log_y).sum(-1) / count
    dx = np.where(mask, log_c - mean_x[..., None], 0.0)
    dy = np.where(mask, log_y - mean_y[..., None], 0.0)
    sxx = (dx * dx).sum(-1)
    slope = (dx * dy).sum(-1) / sxx
    slope = np.where(sxx > 1e-12, slope, np.nan)
  return mean_y - slope * mean_x, slope


@dataclasses.dataclass(frozen=True)
class FrontierFit:
  """N_opt = G_N·C^a and D_opt = G_D·C^b with intervals, and the answer at a target."""
  approach: str
  a: Estimate
  b: Estimate
  G_N: Estimate
  G_D: Estimate
  target_flops: float
  n_opt: Estimate
  d_opt: Estimate
  replicates: int
  failed_replicates: int
  details: Dict[str, object] = dataclasses.field(default_factory=dict)

  def predict_n(self, flops) -> np.ndarray:
    return self.G_N.value * np.power(np.asarray(flops, np.float64), self.a.value)

  def predict_d(self, flops) -> np.ndarray:
    return self.G_D.value * np.power(np.asarray(flops, np.float64), self.b.value)

  def to_json(self) -> Dict[str, object]:
    out = {"approach": self.approach}
    for name in ("a", "b", "G_N", "G_D"):
      out[name] = getattr(self, name).to_json()
    out["target_flops"] = self.target_flops
    out["N_opt"] = self.n_opt.to_json()
    out["D_opt"] = self.d_opt.to_json()
    out["bootstrap"] = {"replicates": self.replicates, "failed": self.failed_replicates}
    out.update(self.details)
    return out


def _frontier(approach: str, log_c: np.ndarray, log_n: np.ndarray, log_d: np.ndarray,
              mask: np.ndarray, target_flops: float, confidence: float,
              details: Dict[str, object]) -> FrontierFit:
  """Power laws in C from [1 + replicates, points] optima (row 0: the data itself)."""
  int_n, a = _power_law(log_c, log_n, mask)
  int_d, b = _power_law(log_c, log_d, mask)
  if not np.isfinite(a[0]):
    raise ValueError(f"approach {approach}: the optima span fewer than 2 distinct "
                     "compute values; add runs at more budgets")
  log_t = math.log(target_flops)
  n_t = np.exp(int_n + a * log_t)
  d_t = np.exp(int_d + b * log_t)
  ok = np.isfinite(a[1:]) & np.isfinite(b[1:])

  def est(values):
    return _interval(values[1:][ok], values[0], confidence)
  return FrontierFit(approach, est(a), est(b), est(np.exp(int_n)), est(np.exp(int_d)),
                     target_flops, est(n_t), est(d_t), replicates=int(ok.sum()),
                     failed_replicates=int((~ok).sum()), details=details)


# -- Approach 1: lower envelope of the training curves -------------------------------------
def _envelope_candidates(runs: Runs, grid_points: int):
  """[runs, grid] log loss (inf where a run has no point), the grid's log C, and each
  candidate's log C (grid value, or a single point's own compute)."""
  log_c_runs = np.log(runs.flops)
  flops_per_token = runs.flops / runs.tokens
  hi = float(log_c_runs.max())
  curves = runs.curves or [None] * len(runs.params)
  spans = []
  for i, curve in enumerate(curves):
    if curve is None or len(curve[0]) < 2:
      spans.append((log_c_runs[i], log_c_runs[i]))
    else:
      log_c = np.log(np.asarray(curve[0], np.float64) * flops_per_token[i])
      spans.append((float(log_c.min()), float(log_c.max())))
  lo = min(s[0] for s in spans)
  grid = np.linspace(lo, hi, grid_points)
  log_loss = np.full((len(curves), grid_points), np.inf)
  cand_log_c = np.broadcast_to(grid, log_loss.shape).copy()
  for i, curve in enumerate(curves):
    if curve is None or len(curve[0]) < 2:
      node = int(np.argmin(np.abs(grid - log_c_runs[i])))
      log_loss[i, node] = math.log(runs.loss[i])
      cand_log_c[i, node] = log_c_runs[i]
      continue
    log_c = np.log(np.asarray(curve[0], np.float64) * flops_per_token[i])
    order = np.argsort(log_c)
    inside = (grid >= log_c[order[0]]) & (grid <= log_c[order[-1]])
    log_loss[i, inside] = np.interp(grid[inside], log_c[order],
                                    np.log(np.asarray(curve[1], np.float64)[order]))
  return log_loss, grid, cand_log_c


def _envelope(log_loss, cand_log_c, log_n_runs, log_k_runs, rows):
  """Envelope optima for [batch, runs] resampled run indices `rows`."""
  batch = np.arange(rows.shape[0])[:, None]
  loss = log_loss[rows]                                   # [batch, runs, grid]
  best = np.argmin(loss, axis=1)                          # [batch, grid]
  best_loss = np.take_along_axis(loss, best[:, None], 1)[:, 0]
  run = rows[batch, best]
  log_c = np.take_along_axis(cand_log_c[rows], best[:, None], 1)[:, 0]
  # A node is on the envelope if no earlier compute reached a loss as low.
  previous = np.minimum.accumulate(np.concatenate(
      [np.full((rows.shape[0], 1), np.inf), best_loss[:, :-1]], axis=1), axis=1)
  mask = np.isfinite(best_loss) & (best_loss < previous)
  log_n = log_n_runs[run]
  # Where the smallest or largest model of the resample wins, the optimum may lie
  # beyond the sizes trained: those nodes would flatten the power law, so they go.
  sizes = log_n_runs[rows]
  mask &= (log_n > sizes.min(1, keepdims=True)) & (log_n < sizes.max(1, keepdims=True))
  log_d = log_c - log_k_runs[run] - log_n
  return log_c, log_n, log_d, mask


def fit_envelope(runs: Runs, target_flops: float, *, replicates: int = 200,
                 confidence: float = DEFAULT_CONFIDENCE, seed: int = 0,
                 grid_points: int = ENVELOPE_GRID_POINTS) -> FrontierFit:
  """Approach 1 (module docstring); whole runs are resampled for the intervals."""
  log_loss, _, cand_log_c = _envelope_candidates(runs, grid_points)
  n = len(runs.params)
  rng = np.random.default_rng(seed)
  rows = np.concatenate([np.arange(n)[None], rng.integers(0, n, (replicates, n))])
  log_k = np.log(runs.flops / (runs.params * runs.tokens))
  log_c, log_n, log_d, mask = _envelope(log_loss, cand_log_c, np.log(runs.params), log_k,
                                        rows)
  details = {"envelope": [{"flops": float(math.exp(c)), "N": float(math.exp(nn)),
                           "D": float(math.exp(d))}
                          for c, nn, d, m in zip(log_c[0], log_n[0], log_d[0], mask[0])
                          if m]}
  return _frontier("1: lower envelope", log_c, log_n, log_d, mask, target_flops,
                   confidence, details)


# -- Approach 2: isoFLOP profiles ------------------------------------------------------------
def _parabola_vertices(x: np.ndarray, y: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """Batched least-squares parabolas y = c0 + c1·x + c2·x² over the last axis: the
  vertex x and whether it is a bracketed minimum (c2 > 0, inside the sampled x)."""
  xc = x - x.mean(-1, keepdims=True)              # centred for conditioning
  scale = np.maximum(np.abs(xc).max(-1, keepdims=True), 1e-12)
  u = xc / scale
  design = np.stack([np.ones_like(u), u, u * u], -1)
  gram = np.einsum("...ni,...nj->...ij", design, design)
  rhs = np.einsum("...ni,...n->...i", design, y)
  det = np.linalg.det(gram)
  safe = np.abs(det) > 1e-9
  gram = np.where(safe[..., None, None], gram, np.eye(3))
  coef = np.linalg.solve(gram, rhs[..., None])[..., 0]
  with np.errstate(invalid="ignore", divide="ignore"):
    vertex_u = -coef[..., 1] / (2 * coef[..., 2])
  vertex = vertex_u * scale[..., 0] + x.mean(-1)
  ok = safe & (coef[..., 2] > 0) & (vertex >= x.min(-1)) & (vertex <= x.max(-1))
  return vertex, ok


def fit_isoflop(runs: Runs, target_flops: float, *, replicates: int = 200,
                confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> FrontierFit:
  """Approach 2 (module docstring); runs are resampled within each budget."""
  rng = np.random.default_rng(seed)
  budgets = np.unique(runs.budget)
  log_c_rows, log_n_rows, log_d_rows, ok_rows, per_budget = [], [], [], [], []
  for budget in budgets:
    members = np.flatnonzero(runs.budget == budget)
    if len(np.unique(runs.params[members])) < 3:
      per_budget.append({"budget": float(budget), "runs": int(len(members)),
                         "used": False, "reason": "fewer than 3 distinct sizes"})
      continue
    pick = np.concatenate([members[None], members[rng.integers(0, len(members),
                                                               (replicates, len(members)))]])
    x = np.log(runs.params[pick])
    vertex, ok = _parabola_vertices(x, runs.loss[pick])
    log_c = math.log(float(np.exp(np.log(runs.flops[members]).mean())))
    log_k = float(np.log(runs.flops[members] / (runs.params[members]
                                                * runs.tokens[members])).mean())
    log_c_rows.append(np.full(replicates + 1, log_c))
    log_n_rows.append(vertex)
    log_d_rows.append(log_c - log_k - vertex)
    ok_rows.append(ok)
    entry = {"budget": float(budget), "flops": math.exp(log_c), "runs": int(len(members)),
             "used": bool(ok[0])}
    if ok[0]:
      n_opt = _interval(np.exp(vertex[1:][ok[1:]]), math.exp(vertex[0]), confidence)
      entry.update(N_opt=n_opt.to_json(), D_opt=math.exp(log_c - log_k - vertex[0]))
    else:
      entry["reason"] = "the parabola's minimum is not inside the sampled sizes"
    per_budget.append(entry)
  if len(log_c_rows) < 2:
    raise ValueError("approach 2 needs at least 2 budgets with 3 or more distinct sizes "
                     "each; use an isoFLOP design (--flop_budgets)")
  stack = lambda rows: np.stack(rows, axis=1)  # noqa: E731  [replicates + 1, budgets]
  return _frontier("2: isoFLOP profiles", stack(log_c_rows), stack(log_n_rows),
                   stack(log_d_rows), stack(ok_rows), target_flops, confidence,
                   {"budgets": per_budget})


# -- Approach 3: parametric L(N, D) ------------------------------------------------------------
PARAMETRIC_NAMES = ("E", "A", "B", "alpha", "beta")


def _huber(residual: np.ndarray, delta: float) -> np.ndarray:
  return np.where(np.abs(residual) <= delta, 0.5 * residual ** 2,
                  delta * (np.abs(residual) - 0.5 * delta))


def _residuals(theta: np.ndarray, log_n, log_d, log_loss):
  """Log-loss residuals [fits, runs] of [fits, 5] parameters and their softmax weights."""
  e, a, b, alpha, beta = (c[:, None] for c in theta.T)
  terms = np.stack([a - alpha * log_n, b - beta * log_d,
                    np.broadcast_to(e, (len(e), len(log_n)))])
  top = terms.max(0)
  expo = np.exp(terms - top)
  total = expo.sum(0)
  return top + np.log(total) - log_loss, expo / total


def _jacobian(soft: np.ndarray, log_n, log_d) -> np.ndarray:
  """d residual / d (e, a, b, α, β): [fits, runs, 5]."""
  return np.stack([soft[2], soft[0], soft[1], -soft[0] * log_n, -soft[1] * log_d], -1)


def _objective(theta, log_n, log_d, log_loss, weights, delta) -> np.ndarray:
  """Each fit's weighted Huber loss, divided by δ (so large residuals count as |r|)."""
  residual, _ = _residuals(theta, log_n, log_d, log_loss)
  return (weights * _huber(residual, delta)).sum(-1) / delta


def _scipy_objective(theta, log_n, log_d, log_loss, weights, delta):
  residual, soft = _residuals(theta[None], log_n, log_d, log_loss)
  slope = weights * np.clip(residual[0], -delta, delta) / delta
  grad = slope @ _jacobian(soft[:, 0], log_n, log_d)
  return float(weights @ _huber(residual[0], delta)) / delta, grad


def _grid_starts(log_n, log_d, log_loss, weights: np.ndarray, delta: float, count: int
                 ) -> np.ndarray:
  """The `count` best points of the starting grid for each row of [fits, runs] weights
  (vectorised: one Huber matrix of every grid point and run): [fits, count, 5]."""
  e, a, b, alpha, beta = np.meshgrid(_GRID_LOG_E, _GRID_LOG_AB, _GRID_LOG_AB,
                                     _GRID_EXPONENTS, _GRID_EXPONENTS, indexing="ij")
  grid = np.stack([g.ravel() for g in (e, a, b, alpha, beta)], 1)     # [starts, 5]
  residual, _ = _residuals(grid, log_n, log_d, log_loss)
  objective = weights @ _huber(residual, delta).T                      # [fits, starts]
  return grid[np.argsort(objective, axis=1)[:, :count]]


def _lbfgs(start: np.ndarray, log_n, log_d, log_loss, weights, delta):
  bounds = [(None, None)] * 3 + [(0.0, 5.0)] * 2
  result = optimize.minimize(_scipy_objective, start, jac=True, method="L-BFGS-B",
                             args=(log_n, log_d, log_loss, weights, delta), bounds=bounds,
                             options={"maxiter": 2000, "ftol": 1e-13, "gtol": 1e-10})
  return result.x, float(result.fun)


def _irls(theta: np.ndarray, log_n, log_d, log_loss, weights, delta,
          iterations: int = 200) -> Tuple[np.ndarray, np.ndarray]:
  """Batched minimisation of the same Huber objective for [fits, 5] starting points.

  Iteratively reweighted Gauss-Newton (Huber weights min(1, δ/|r|)) with Levenberg
  damping and a step accepted only where it lowers that fit's objective: a few dozen
  5x5 solves per fit, all fits at once. It reaches the optima L-BFGS reaches (to ~1e-8
  on the parameters) in a fraction of the time, which makes hundreds of bootstrap
  refits affordable; the point estimate is polished with L-BFGS (`fit_parametric`).
  """
  theta = theta.copy()
  value = _objective(theta, log_n, log_d, log_loss, weights, delta)
  damping = np.full(len(theta), 1e-3)
  for _ in range(iterations):
    residual, soft = _residuals(theta, log_n, log_d, log_loss)
    jac = _jacobian(soft, log_n, log_d)
    w = weights * np.minimum(1.0, delta / np.maximum(np.abs(residual), 1e-300))
    gram = np.einsum("fr,fri,frj->fij", w, jac, jac)
    grad = np.einsum("fr,fri->fi", w * residual, jac)
    diag = np.einsum("fii->fi", gram)
    step = -np.linalg.solve(gram + damping[:, None, None] * (
        np.eye(5) * (diag[:, None, :] + 1e-12)), grad[..., None])[..., 0]
    candidate = theta + step
    candidate[:, 3:] = np.clip(candidate[:, 3:], 0.0, 5.0)
    new_value = _objective(candidate, log_n, log_d, log_loss, weights, delta)
    accept = np.isfinite(new_value) & (new_value <= value)
    theta[accept] = candidate[accept]
    improvement = np.where(accept, value - new_value, 0.0)
    value = np.where(accept, new_value, value)
    damping = np.clip(np.where(accept, damping / 3, damping * 4), 1e-9, 1e9)
    if np.all((improvement <= 1e-12 * np.maximum(value, 1e-30)) & accept | (damping >= 1e9)):
      break
  return theta, value


@dataclasses.dataclass(frozen=True)
class ParametricFit:
  """L(N, D) = E + A/N^α + B/D^β with intervals, and its compute-optimal frontier."""
  params: Dict[str, Estimate]
  frontier: FrontierFit
  loss_at_target: Estimate
  flops_per_param_token: float
  huber_delta: float
  objective: float
  # The bootstrap refits' (log E, log A, log B, α, β), one row each: what `loss_at`'s
  # interval is taken over.
  replicate_thetas: np.ndarray = dataclasses.field(
      default_factory=lambda: np.zeros((0, 5)), compare=False, repr=False)
  confidence: float = DEFAULT_CONFIDENCE

  def predict(self, n, d) -> np.ndarray:
    p = {k: v.value for k, v in self.params.items()}
    return (p["E"] + p["A"] / np.power(np.asarray(n, np.float64), p["alpha"])
            + p["B"] / np.power(np.asarray(d, np.float64), p["beta"]))

  def loss_at(self, n: float, d: float) -> Estimate:
    """The fitted loss of a model of N parameters trained on D tokens, with the
    percentile interval of the bootstrap refits' losses there (the uncertainty of the
    fit; a single run's own seed-to-seed spread comes on top)."""
    e, log_a, log_b, alpha, beta = self.replicate_thetas.T
    with np.errstate(all="ignore"):
      losses = np.exp(e) + np.exp(log_a - alpha * math.log(n)) + np.exp(
          log_b - beta * math.log(d))
    point = float(self.predict(n, d))
    return _interval(losses, point, self.confidence)

  def to_json(self) -> Dict[str, object]:
    out = {"approach": "3: parametric L(N, D)", "law": "E + A/N^alpha + B/D^beta"}
    out.update({k: v.to_json() for k, v in self.params.items()})
    frontier = self.frontier.to_json()
    frontier.pop("approach")
    out.update(frontier)
    out["loss_at_target"] = self.loss_at_target.to_json()
    out["flops_per_param_token"] = self.flops_per_param_token
    out["huber_delta"] = self.huber_delta
    out["objective"] = self.objective
    return out


def _optimal_allocation(theta: np.ndarray, k: float, flops: float):
  """N_opt, D_opt, G_N, G_D, a, b and the loss at N_opt, D_opt for C = k·N·D."""
  e, log_a, log_b, alpha, beta = theta
  with np.errstate(all="ignore"):
    g = np.exp((np.log(alpha) + log_a - np.log(beta) - log_b) / (alpha + beta))
    a, b = beta / (alpha + beta), alpha / (alpha + beta)
    g_n = g * k ** -a
    g_d = k ** -b / g
    n_opt, d_opt = g_n * flops ** a, g_d * flops ** b
    loss = np.exp(e) + np.exp(log_a) * n_opt ** -alpha + np.exp(log_b) * d_opt ** -beta
  return n_opt, d_opt, g_n, g_d, a, b, loss


def fit_parametric(runs: Runs, target_flops: float, *, replicates: int = 100,
                   confidence: float = DEFAULT_CONFIDENCE, seed: int = 0,
                   delta: float = HUBER_DELTA) -> ParametricFit:
  """Approach 3 (module docstring): Huber on log loss, grid starts, L-BFGS, bootstrap.

  The point estimate: `_irls` from the `_STARTS` best grid points at once, then
  L-BFGS from the best of their optima (scipy's L-BFGS-B costs milliseconds per
  iteration, so it polishes one optimum rather than running from every start). Each bootstrap replicate minimises the same objective on its resample
  (`_irls`, batched) from the full data's optimum and from its own best grid point.
  """
  if len(runs.params) < 6:
    raise ValueError(f"approach 3 fits 5 parameters; it needs at least 6 runs, got "
                     f"{len(runs.params)}")
  log_n, log_d, log_loss = np.log(runs.params), np.log(runs.tokens), np.log(runs.loss)
  n = len(log_n)
  ones = np.ones(n)
  starts = _grid_starts(log_n, log_d, log_loss, ones[None], delta, _STARTS)[0]
  optima, values = _irls(starts, log_n, log_d, log_loss, np.broadcast_to(ones, starts.shape[:1]
                                                                         + ones.shape), delta)
  theta, objective = _lbfgs(optima[np.argmin(values)], log_n, log_d, log_loss, ones, delta)
  rng = np.random.default_rng(seed)
  weights = np.stack([np.bincount(rng.integers(0, n, n), minlength=n)
                      for _ in range(replicates)]).astype(np.float64)
  starts = np.concatenate([np.broadcast_to(theta, (replicates, 5)),
                           _grid_starts(log_n, log_d, log_loss, weights, delta, 1)[:, 0]])
  optima, values = _irls(starts, log_n, log_d, log_loss,
                         np.concatenate([weights, weights]), delta)
  better = values[replicates:] < values[:replicates]
  refits = np.where(better[:, None], optima[replicates:], optima[:replicates])
  thetas = np.concatenate([theta[None], refits])
  k = runs.flops_per_param_token
  n_opt, d_opt, g_n, g_d, a, b, loss = _optimal_allocation(thetas.T, k, target_flops)
  ok = np.all(np.isfinite(thetas[1:]), axis=1)

  def est(values):
    return _interval(values[1:][ok], values[0], confidence)
  natural = {"E": np.exp(thetas[:, 0]), "A": np.exp(thetas[:, 1]), "B": np.exp(thetas[:, 2]),
             "alpha": thetas[:, 3], "beta": thetas[:, 4]}
  frontier = FrontierFit("3: parametric L(N, D)", est(a), est(b), est(g_n), est(g_d),
                         target_flops, est(n_opt), est(d_opt), int(ok.sum()),
                         int((~ok).sum()))
  return ParametricFit({name: est(natural[name]) for name in PARAMETRIC_NAMES}, frontier,
                       est(loss), k, delta, objective, thetas[1:][ok], confidence)


def compute_optimal_loss(fit: ParametricFit, flops: Sequence[float]) -> np.ndarray:
  """The fitted law's loss along its compute-optimal frontier at each of `flops`."""
  p = fit.params
  theta = np.array([math.log(p["E"].value), math.log(p["A"].value), math.log(p["B"].value),
                    p["alpha"].value, p["beta"].value])
  return _optimal_allocation(theta[:, None], fit.flops_per_param_token,
                             np.asarray(flops, np.float64))[-1]
