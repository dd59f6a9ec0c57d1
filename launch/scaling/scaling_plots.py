"""Figures of a scaling study: isoFLOP profiles, loss against compute, fitted contours.

Written with matplotlib's Agg backend (no display needed) at 200 dpi, one PNG each, so
they can go into a paper or a report as they are.
"""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional

import numpy as np

from launch.scaling import scaling_laws

_DPI = 200


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top  (optional heavy dependency)
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  return pyplot


def _save(fig, path: str) -> str:
  fig.tight_layout()
  fig.savefig(path, dpi=_DPI)
  fig.clf()
  return path


def plot_isoflop(runs: scaling_laws.Runs, fit: Optional[scaling_laws.FrontierFit],
                 path: str, title: str, ylabel: str) -> str:
  """Loss against N for each budget, the fitted parabolas and their minima."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6.4, 4.6))
  budgets = np.unique(runs.budget)
  colours = plt.cm.viridis(np.linspace(0.05, 0.9, len(budgets)))
  for colour, budget in zip(colours, budgets):
    members = runs.budget == budget
    x, y = np.log(runs.params[members]), runs.loss[members]
    ax.scatter(np.exp(x), y, color=colour, s=18, zorder=3, label=f"C = {budget:.2g}")
    if len(np.unique(x)) >= 3:
      coef = np.polyfit(x, y, 2)
      grid = np.linspace(x.min(), x.max(), 100)
      ax.plot(np.exp(grid), np.polyval(coef, grid), color=colour, lw=1)
      if coef[0] > 0:
        vertex = -coef[1] / (2 * coef[0])
        if x.min() <= vertex <= x.max():
          ax.plot(np.exp(vertex), np.polyval(coef, vertex), "*", color=colour, ms=11,
                  markeredgecolor="black", zorder=4)
  ax.set_xscale("log")
  ax.set_xlabel("parameters N")
  ax.set_ylabel(ylabel)
  ax.set_title(title + (f" (N_opt ∝ C^{fit.a.value:.3f})" if fit else ""))
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7)
  return _save(fig, path)


def plot_loss_vs_compute(families: Mapping[str, scaling_laws.Runs],
                         parametric: Mapping[str, scaling_laws.ParametricFit],
                         path: str, ylabel: str) -> str:
  """Every run's loss against its compute, and each family's fitted frontier L*(C)."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6.4, 4.6))
  colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, (family, runs) in enumerate(families.items()):
    colour = colours[i % len(colours)]
    ax.scatter(runs.flops, runs.loss, color=colour, s=14, alpha=0.7, label=family)
    if family in parametric:
      fit = parametric[family]
      grid = np.geomspace(runs.flops.min() / 2, runs.flops.max() * 4, 100)
      p = fit.params
      ax.plot(grid, scaling_laws.compute_optimal_loss(fit, grid), color=colour, lw=1.5,
              label=f"{family}: compute-optimal L(N,D) fit, α={p['alpha'].value:.2f}, "
                    f"β={p['beta'].value:.2f}")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("training FLOPs C")
  ax.set_ylabel(ylabel)
  ax.set_title("Loss against compute, with the fitted frontier")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7)
  return _save(fig, path)


def plot_contours(runs: scaling_laws.Runs, fit: scaling_laws.ParametricFit, path: str,
                  title: str) -> str:
  """Contours of the fitted L(N, D) over the data's range, the runs and the frontier."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6.4, 4.6))
  n = np.geomspace(runs.params.min() / 3, runs.params.max() * 3, 120)
  d = np.geomspace(runs.tokens.min() / 3, runs.tokens.max() * 3, 120)
  grid_n, grid_d = np.meshgrid(n, d)
  levels = np.quantile(fit.predict(grid_n, grid_d), np.linspace(0.02, 0.98, 14))
  contour = ax.contour(grid_n, grid_d, fit.predict(grid_n, grid_d), levels=np.unique(levels),
                       cmap="viridis_r", linewidths=0.8)
  ax.clabel(contour, fontsize=6, fmt="%.2f")
  ax.scatter(runs.params, runs.tokens, c="black", s=8, zorder=3, label="runs")
  flops = np.geomspace(runs.flops.min() / 3, runs.flops.max() * 3, 50)
  ax.plot(fit.frontier.predict_n(flops), fit.frontier.predict_d(flops), "r-", lw=1.5,
          label="compute-optimal frontier")
  ax.set_xlim(n[0], n[-1])
  ax.set_ylim(d[0], d[-1])
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("parameters N")
  ax.set_ylabel("training tokens D")
  ax.set_title(title)
  ax.legend(fontsize=7)
  return _save(fig, path)


def write_plots(families: Mapping[str, scaling_laws.Runs],
                isoflop: Mapping[str, scaling_laws.FrontierFit],
                parametric: Mapping[str, scaling_laws.ParametricFit],
                directory: str, ylabel: str) -> Dict[str, str]:
  """All figures of a study into `directory`, the fitted metric named `ylabel`;
  returns name -> path."""
  os.makedirs(directory, exist_ok=True)
  paths = {"loss_vs_compute": plot_loss_vs_compute(
      families, parametric, os.path.join(directory, "loss_vs_compute.png"), ylabel)}
  for family, runs in families.items():
    if len(np.unique(runs.budget)) < len(runs.budget):
      paths[f"isoflop_{family}"] = plot_isoflop(
          runs, isoflop.get(family), os.path.join(directory, f"isoflop_{family}.png"),
          f"{family}: isoFLOP profiles", ylabel)
    if family in parametric:
      paths[f"contours_{family}"] = plot_contours(
          runs, parametric[family], os.path.join(directory, f"contours_{family}.png"),
          f"{family}: fitted L(N, D)")
  _pyplot().close("all")
  return paths
