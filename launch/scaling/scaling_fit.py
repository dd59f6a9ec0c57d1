"""Scaling-law analysis of a study or of any runs: `python -m launch.scaling_fit`.

The library of `python -m launch.scaling_fit` (launch/scaling_fit.py, whose docstring is the
command's manual; its flags and main are there).

Below: the single power law of loss against compute per family that `launch.sweep`
reports for a fixed tokens-per-parameter design.

The scaling law is L(C) = E + A · C^(-α): an irreducible loss E plus a power law in the
training FLOPs C (Kaplan et al. 2020; Hoffmann et al. 2022). We fit it by least squares
on log L (scipy `curve_fit`), so every point weighs by its relative error, and
parametrise it around the geometric mean C0 of the data,

    log L = log(E + A0 · (C / C0)^(-α)),   A = A0 · C0^α,

which keeps the parameters of order one and their covariance well conditioned. The
uncertainties are the square roots of the diagonal of `curve_fit`'s covariance (scaled by
the residual variance), propagated to A by the delta method. Several starting points are
tried and the best fit kept, since the loss surface in E is flat and not convex.

A full fit needs more points than its 3 parameters to say anything about its errors.
With 3 points or fewer per family we fit the floor-free power law L = A · C^(-α)
(2 parameters) instead and say so in the result's `form`; a sweep of 3 sizes then still
gets an exponent with an uncertainty.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import tempfile
import warnings
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
from scipy import optimize

from launch.scaling import scaling_laws
from launch.scaling import scaling_plots
from plumbing import storage
from plumbing.errors import usage_error

FULL_FORM = "E + A*C^-alpha"
POWER_FORM = "A*C^-alpha"


@dataclasses.dataclass(frozen=True)
class ScalingFit:
  """A fitted L(C); `*_err` are one-sigma uncertainties (None: not estimable)."""
  form: str
  E: float
  A: float
  alpha: float
  E_err: Optional[float]
  A_err: Optional[float]
  alpha_err: Optional[float]
  n_points: int
  rms_log_residual: float

  def predict(self, flops) -> np.ndarray:
    return self.E + self.A * np.power(np.asarray(flops, np.float64), -self.alpha)

  def to_json(self) -> Dict[str, object]:
    return dataclasses.asdict(self)


def _finite_or_none(value: float) -> Optional[float]:
  return float(value) if np.isfinite(value) else None


def fit_scaling_law(flops: Sequence[float], losses: Sequence[float],
                    with_floor: Optional[bool] = None) -> ScalingFit:
  """Fits L(C) = E + A·C^(-α) (or A·C^(-α)) in log space.

  Args:
    flops: training FLOPs C of each run (> 0).
    losses: final evaluation loss of each run (> 0).
    with_floor: fit E; default: only when there are more than 3 points.

  Returns:
    The fit with its uncertainties.
  """
  c = np.asarray(flops, np.float64)
  loss = np.asarray(losses, np.float64)
  if c.shape != loss.shape or c.ndim != 1:
    raise ValueError(f"flops and losses must be 1-D of the same length, got {c.shape} "
                     f"and {loss.shape}")
  if len(c) < 2:
    raise ValueError(f"a scaling fit needs at least 2 runs, got {len(c)}")
  if np.any(c <= 0) or np.any(loss <= 0) or not np.all(np.isfinite(c * loss)):
    raise ValueError("flops and losses must be positive and finite")
  if len(np.unique(c)) < 2:
    raise ValueError("a scaling fit needs runs at 2 or more different compute budgets")
  if with_floor is None:
    with_floor = len(c) > 3
  log_c0 = float(np.mean(np.log(c)))
  x = np.log(c) - log_c0
  y = np.log(loss)
  slope = np.polyfit(x, y, 1)[0]
  alpha0 = float(np.clip(-slope, 1e-3, 2.0))

  if not with_floor:
    def model(x, log_a0, alpha):
      return log_a0 - alpha * x
    starts = [(float(np.mean(y)), alpha0)]
    bounds = ([-np.inf, -5.0], [np.inf, 5.0])
  else:
    def model(x, e, log_a0, alpha):
      return np.log(e + np.exp(log_a0 - alpha * x))
    floor_max = float(loss.min()) * (1 - 1e-6)
    starts = []
    for fraction in (0.0, 0.3, 0.6, 0.9):
      e = fraction * float(loss.min())
      rest = np.maximum(loss - e, 1e-12)
      local_slope = np.polyfit(x, np.log(rest), 1)
      starts.append((e, float(local_slope[1]), float(np.clip(-local_slope[0], 1e-3, 3.0))))
    bounds = ([0.0, -np.inf, 1e-4], [floor_max, np.inf, 5.0])

  best = None
  for p0 in starts:
    p0 = np.clip(p0, np.asarray(bounds[0]) + 1e-9, np.asarray(bounds[1]) - 1e-9)
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", optimize.OptimizeWarning)
        params, cov = optimize.curve_fit(model, x, y, p0=p0, bounds=bounds, maxfev=20000)
    except RuntimeError:
      continue
    sse = float(np.sum((model(x, *params) - y) ** 2))
    if best is None or sse < best[2]:
      best = (params, cov, sse)
  if best is None:
    raise RuntimeError("the scaling-law fit did not converge from any starting point")
  params, cov, sse = best
  dof = len(c) - len(params)
  if dof <= 0:
    cov = np.full_like(cov, np.inf)
  variances = np.diag(cov)

  if with_floor:
    e, log_a0, alpha = params
    e_err = _finite_or_none(math.sqrt(variances[0])) if variances[0] >= 0 else None
    i_a, i_alpha = 1, 2
  else:
    (log_a0, alpha), e, e_err = params, 0.0, 0.0
    i_a, i_alpha = 0, 1
  log_a = log_a0 + alpha * log_c0
  var_log_a = (variances[i_a] + log_c0 ** 2 * variances[i_alpha]
               + 2 * log_c0 * cov[i_a, i_alpha])
  a = math.exp(log_a)
  a_err = _finite_or_none(a * math.sqrt(var_log_a)) if var_log_a >= 0 else None
  alpha_err = _finite_or_none(math.sqrt(variances[i_alpha]))
  return ScalingFit(
      form=FULL_FORM if with_floor else POWER_FORM, E=float(e), A=a, alpha=float(alpha),
      E_err=e_err if with_floor else None, A_err=a_err, alpha_err=alpha_err,
      n_points=len(c), rms_log_residual=math.sqrt(sse / len(c)))


def _format(value: Optional[float], err: Optional[float] = None, digits: int = 3) -> str:
  if value is None:
    return "n/a"
  text = f"{value:.{digits}g}"
  return text if err is None else f"{text} ± {err:.2g}"


def fit_table_markdown(fits: Mapping[str, ScalingFit]) -> str:
  """One row per family: the fitted law and its uncertainties."""
  rows = ["| family | form | E | A | α | points | rms log residual |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
  for family, fit in fits.items():
    rows.append(f"| {family} | {fit.form} | {_format(fit.E, fit.E_err)} | "
                f"{_format(fit.A, fit.A_err)} | {_format(fit.alpha, fit.alpha_err)} | "
                f"{fit.n_points} | {fit.rms_log_residual:.3g} |")
  return "\n".join(rows)


def plot_scaling(points: Mapping[str, tuple[Sequence[float], Sequence[float]]],
                 fits: Mapping[str, ScalingFit], path: str,
                 title: str = "Final evaluation loss against training compute") -> None:
  """Log-log loss against FLOPs: one colour per family, fitted curves dashed."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(6.4, 4.6))
  colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, (family, (flops, losses)) in enumerate(points.items()):
    colour = colours[i % len(colours)]
    ax.scatter(flops, losses, color=colour, zorder=3, label=family)
    if family in fits:
      fit = fits[family]
      grid = np.geomspace(min(flops) / 1.5, max(flops) * 1.5, 100)
      err = f" ± {fit.alpha_err:.2g}" if fit.alpha_err is not None else ""
      ax.plot(grid, fit.predict(grid), "--", color=colour,
              label=f"{family} fit: α = {fit.alpha:.3f}{err}")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("training FLOPs")
  ax.set_ylabel("final evaluation loss (nats/token)")
  ax.set_title(title)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# -- The three approaches from the command line ----------------------------------------------
REQUIRED_COLUMNS = ("params", "tokens")
APPROACHES = ("1", "2", "3", "all")
# --metric: sweep.csv column -> (its metrics.jsonl evaluation field, the figures' axis).
METRICS = {"loss": ("eval_loss", "final evaluation loss (nats/token)"),
           "bits_per_byte": ("eval_bits_per_byte", "final evaluation bits per byte")}


def _read_curve(workdir: str, tokens_per_step: float, field: str) -> Optional[tuple]:
  """(tokens, `field`) of a run's metrics.jsonl evaluation rows, or None."""
  path = storage.join(workdir, "metrics.jsonl")
  if not storage.exists(path):
    return None
  steps, losses = [], []
  for line in storage.read_text(path).splitlines():
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue  # a line cut short by a kill
    if row.get(field) is not None and row.get("step", 0) > 0:
      steps.append(float(row["step"]))
      losses.append(float(row[field]))
  if not steps:
    return None
  return np.asarray(steps) * tokens_per_step, np.asarray(losses)


def read_runs(path: str, metric: str = "loss") -> Dict[str, scaling_laws.Runs]:
  """Runs per family from a CSV file or a study directory (module docstring), `metric`
  (a `METRICS` column) as their loss.

  Raises:
    UserError (exit code 2): a missing file or column (e.g. `bits_per_byte` in a
      sweep.csv written before it was recorded), or a value that is not a number.
  """
  study = storage.isdir(path)
  csv_path = storage.join(path, "sweep.csv") if study else path
  if not storage.exists(csv_path):
    raise usage_error(f"--runs: {csv_path} does not exist; pass a CSV with the columns "
                      f"params,tokens,{metric} or a study directory holding sweep.csv")
  reader = csv.DictReader(io.StringIO(storage.read_text(csv_path), newline=""))
  missing = [c for c in REQUIRED_COLUMNS + (metric,) if c not in (reader.fieldnames or [])]
  if missing:
    raise usage_error(f"--runs: {csv_path} has no column {', '.join(missing)}; it needs "
                      f"params, tokens and {metric} (flops, family, flop_budget optional)")
  # A forked study's stable runs end without a cooldown: their forks are the (N, D)
  # points, each fork's curve its cooldown (launch.sweeps.wsd_design).
  rows = [r for r in reader if (r.get(metric) or "").strip() and r.get("role") != "stable"]
  grouped: Dict[str, List[dict]] = {}
  for row in rows:
    grouped.setdefault(row.get("family") or "all", []).append(row)
  if not grouped:
    raise usage_error(f"--runs: {csv_path} has no finished run (no row with a {metric})")
  families = {}
  for family, members in grouped.items():
    try:
      number = lambda name: [float(r[name]) for r in members]  # noqa: E731
      flops = number("flops") if all((r.get("flops") or "").strip() for r in members) else None
      budget = (number("flop_budget") if all((r.get("flop_budget") or "").strip()
                                             for r in members) else None)
      curves = None
      if study and all(r.get("workdir") and r.get("train_steps") for r in members):
        curves = [_read_curve(r["workdir"], float(r["tokens"]) / float(r["train_steps"]),
                              METRICS[metric][0]) for r in members]
      families[family] = scaling_laws.Runs.from_columns(
          number("params"), number("tokens"), number(metric), flops, budget, curves)
    except ValueError as error:
      raise usage_error(f"--runs: {csv_path}, family {family}: {error}") from None
  return families


def analyse(runs: scaling_laws.Runs, approaches: Sequence[str], target_flops: float,
            replicates: int, confidence: float, seed: int) -> Dict[str, object]:
  """The requested approaches' fits; an approach the data cannot support says why."""
  fitters = {
      "1": lambda: scaling_laws.fit_envelope(runs, target_flops, replicates=replicates,
                                             confidence=confidence, seed=seed),
      "2": lambda: scaling_laws.fit_isoflop(runs, target_flops, replicates=replicates,
                                            confidence=confidence, seed=seed),
      "3": lambda: scaling_laws.fit_parametric(runs, target_flops, replicates=replicates,
                                               confidence=confidence, seed=seed),
  }
  results = {}
  for approach in approaches:
    try:
      results[approach] = fitters[approach]()
    except ValueError as error:
      results[approach] = str(error)
  return results


def _interval_text(estimate: scaling_laws.Estimate) -> str:
  return f"{estimate.value:.4g} [{estimate.low:.4g}, {estimate.high:.4g}]"


def results_markdown(family: str, results: Mapping[str, object], confidence: float) -> str:
  """One table per family: each approach's exponents and answer at the target."""
  pct = f"{100 * confidence:g}%"
  lines = [f"### {family}", "",
           f"| approach | a (N_opt ∝ C^a) | b (D_opt ∝ C^b) | N_opt | D_opt | notes |",
           "| --- | --- | --- | --- | --- | --- |"]
  for approach, fit in results.items():
    if isinstance(fit, str):
      lines.append(f"| {approach} | — | — | — | — | not fitted: {fit} |")
      continue
    frontier = fit.frontier if isinstance(fit, scaling_laws.ParametricFit) else fit
    note = ""
    if isinstance(fit, scaling_laws.ParametricFit):
      note = ", ".join(f"{k} = {_interval_text(v)}" for k, v in fit.params.items())
    lines.append(f"| {frontier.approach} | {_interval_text(frontier.a)} | "
                 f"{_interval_text(frontier.b)} | {_interval_text(frontier.n_opt)} | "
                 f"{_interval_text(frontier.d_opt)} | {note} |")
  lines.append(f"\nValues with {pct} bootstrap intervals; N_opt and D_opt at "
               f"{frontier.target_flops:.3g} FLOPs.")
  return "\n".join(lines)


def write_plots(families: Mapping[str, scaling_laws.Runs],
                isoflop: Mapping[str, scaling_laws.FrontierFit],
                parametric: Mapping[str, scaling_laws.ParametricFit],
                directory: str, metric: str = "loss") -> Dict[str, str]:
  """`scaling_plots.write_plots` into a directory or a `gs://` / `s3://` URL (matplotlib
  writes local files: a URL's figures are drawn in a local staging directory and
  uploaded), the axis named after `metric`; returns name -> path."""
  label = METRICS[metric][1]
  if not storage.is_url(directory):
    return scaling_plots.write_plots(families, isoflop, parametric, directory, label)
  with tempfile.TemporaryDirectory(prefix="griffin_plots_") as staging:
    paths = scaling_plots.write_plots(families, isoflop, parametric, staging, label)
    storage.upload_tree(staging, directory)
  return {name: storage.join(directory, os.path.basename(path))
          for name, path in paths.items()}
