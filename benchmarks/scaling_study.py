r"""A small CPU scaling-law study that tests its own forecast: fit three isoFLOP budgets,
predict a run at a larger budget, train that run, compare.

  nice -n 19 python benchmarks/scaling_study.py [--workdir=workdirs/scaling_study]

1. `launch.sweep` (local backend, one run at a time) trains MQA models on an isoFLOP
   design, budgets `FIT_BUDGETS` x 5 sizes spread 4x either side of the
   20-tokens-per-parameter optimum, on the byte-level sources of the running Python's
   standard library (the embedded corpus of configs/quickstart.gin; no download).
2. Approaches 2 (isoFLOP parabolas) and 3 (parametric L(N, D) = E + A/N^α + B/D^β,
   Huber on log loss, bootstrap) of `launch.scaling.scaling_laws` are fitted to those runs only.
3. The held-out run: `launch.sweep` again, one run spending `HELD_OUT_BUDGET` at
   approach 3's compute-optimal size for it (the size rule then picks the nearest model).
4. Approach 3's forecast of that run's loss at its actual N and D, with the 95%
   interval of the bootstrap refits (`ParametricFit.loss_at`), against the measured loss.

Outputs: `--csv` (every run, its role and approach 3's fitted loss with interval),
`--json` (both fits and the forecast), `--figure` (isoFLOP profiles with the fitted law
and the forecast; loss against compute), and a Markdown summary on stdout. Both sweeps
resume like any `launch.sweep`: running the command again redoes nothing finished, so
a rerun only refits and redraws (about a minute). On 2 shared CPU cores the whole
study took the wall time recorded in benchmarks/RESULTS.md.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from typing import Dict, List, Sequence, Tuple, Union

from absl import flags
import matplotlib
matplotlib.use("Agg")
from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
from matplotlib import ticker  # pylint: disable=g-import-not-at-top
import numpy as np

from launch.scaling import scaling_fit
from launch.scaling import scaling_laws
from plumbing import cli

FAMILY = "mqa"
FIT_BUDGETS = (2.5e11, 6e11, 1.5e12)
HELD_OUT_BUDGET = 4e12
# Every run of the study: data, batch, schedule; the sweep adds the model and the steps.
SWEEP_FLAGS = (
    f"--families={FAMILY}", "--tokens_per_param=20", "--batch_size=16",
    "--sequence_length=64", "--vocab_size=259", "--peak_learning_rate=3e-3",
    "--backend=local", "--parallel=1",
    "--gin_file=configs/base/trainer.gin", "--gin_file=configs/base/optimizer.gin",
    "--gin_file=configs/data/text_files.gin", "--gin_param=TRAIN_FILES='{stdlib}/**/*.py'",
    "--gin_param=EVAL_EVERY=0", "--gin_param=LOG_EVERY=100",
    "--gin_param=CHECKPOINT_EVERY=1000", "--gin_param=TrainConfig.eval_batches=32")
FIT_DESIGN = ("--flop_budgets=" + ",".join(f"{b:g}" for b in FIT_BUDGETS),
              "--points_per_budget=5", "--isoflop_spread=4")
CSV_FIELDS = ("run", "role", "flop_budget", "params", "tokens", "flops", "loss",
              "fitted_loss", "fitted_low", "fitted_high", "width", "depth", "train_steps")


def sweep(workdir: str, design: Sequence[str]) -> None:
  """One `launch.sweep` (it resumes: finished runs are kept)."""
  argv = [sys.executable, "-m", "launch.sweep", *SWEEP_FLAGS, *design, f"--workdir={workdir}"]
  code = subprocess.run(argv, check=False).returncode
  if code:
    raise SystemExit(f"launch.sweep exited with code {code}: {' '.join(argv)}")


def held_out_design(n_target: float) -> List[str]:
  """One run at `HELD_OUT_BUDGET` sized for `n_target` parameters: with one point per
  budget the isoFLOP design trains N* = sqrt(C / (6·tokens_per_param)), so
  tokens_per_param = C / (6·n_target²) puts N* on the target."""
  return [f"--flop_budgets={HELD_OUT_BUDGET:g}", "--points_per_budget=1",
          f"--tokens_per_param={HELD_OUT_BUDGET / (6 * n_target ** 2):.6g}"]


def read_rows(study_dir: str) -> List[Dict[str, str]]:
  with open(os.path.join(study_dir, "sweep.csv"), newline="", encoding="utf-8") as f:
    return list(csv.DictReader(f))


def fit(fit_runs: scaling_laws.Runs, replicates: int
        ) -> Tuple[Union[scaling_laws.FrontierFit, str], scaling_laws.ParametricFit]:
  """Approach 2 (or why it could not be fitted) and approach 3 on the fit runs, each
  answering for `HELD_OUT_BUDGET`."""
  fit2 = scaling_fit.analyse(fit_runs, ["2"], HELD_OUT_BUDGET, replicates, 0.95, 0)["2"]
  fit3 = scaling_laws.fit_parametric(fit_runs, HELD_OUT_BUDGET, replicates=replicates)
  return fit2, fit3


def forecast(fit2: Union[scaling_laws.FrontierFit, str], fit3: scaling_laws.ParametricFit,
             held_out: Dict[str, str]) -> Dict[str, object]:
  """Both fits and approach 3's forecast of the held-out run (a sweep.csv row)."""
  n, d, measured = (float(held_out[k]) for k in ("params", "tokens", "loss"))
  predicted = fit3.loss_at(n, d)
  return {
      "approach_2": fit2 if isinstance(fit2, str) else fit2.to_json(),
      "approach_3": fit3.to_json(),
      "held_out": {"run": held_out["run"], "flop_budget": HELD_OUT_BUDGET,
                   "flops": float(held_out["flops"]), "params": n, "tokens": d,
                   "measured_loss": measured, "predicted_loss": predicted.to_json(),
                   "error": measured - predicted.value,
                   "relative_error": (measured - predicted.value) / measured,
                   "inside_interval": predicted.covers(measured)},
  }


def _profile(fit3: scaling_laws.ParametricFit, budget: float, n: np.ndarray):
  """Approach 3's loss along an isoFLOP profile (D = C/(k·N)), with its interval."""
  d = budget / (fit3.flops_per_param_token * n)
  estimates = [fit3.loss_at(a, b) for a, b in zip(n, d)]
  return (np.array([e.value for e in estimates]), np.array([e.low for e in estimates]),
          np.array([e.high for e in estimates]))


def plot(fit_runs: scaling_laws.Runs, fit3: scaling_laws.ParametricFit,
         result: Dict[str, object], path: str) -> str:
  """Left: the isoFLOP profiles, approach 3's law on each and its forecast at the held-
  out budget (band: 95% of the refits) with the measured run. Right: loss against
  compute, the fitted compute-optimal loss and the held-out run."""
  held = result["held_out"]
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
  budgets = list(np.unique(fit_runs.budget)) + [HELD_OUT_BUDGET]
  colours = plt.cm.viridis(np.linspace(0.05, 0.85, len(budgets)))
  n_grid = np.geomspace(fit_runs.params.min() / 1.5, fit_runs.params.max() * 1.5, 80)
  for colour, budget in zip(colours, budgets):
    value, low, high = _profile(fit3, budget, n_grid)
    held_out = budget == HELD_OUT_BUDGET
    left.plot(n_grid, value, color=colour, lw=1.2, ls="--" if held_out else "-",
              label=f"C = {budget:.2g}" + (" (forecast)" if held_out else ""))
    left.fill_between(n_grid, low, high, color=colour, alpha=0.15 if held_out else 0.08)
    members = fit_runs.budget == budget
    left.scatter(fit_runs.params[members], fit_runs.loss[members], color=colour, s=22,
                 zorder=3)
  pred = held["predicted_loss"]
  for ax, x in ((left, held["params"]), (right, held["flops"])):
    ax.errorbar([x], [pred["value"]], yerr=[[pred["value"] - pred["low"]],
                                           [pred["high"] - pred["value"]]],
                fmt="o", color="crimson", mfc="white", capsize=4, zorder=4,
                label="forecast (95% interval)")
    ax.plot([x], [held["measured_loss"]], "*", color="crimson", ms=13,
            markeredgecolor="black", zorder=5, label="held-out run, measured")
  left.set_ylim(min(pred["low"], held["measured_loss"]) - 0.1, fit_runs.loss.max() + 0.15)
  left.set_xscale("log")
  left.set_xticks([3e4, 1e5, 3e5], ["30k", "100k", "300k"])
  left.set_xlabel("non-embedding parameters N")
  left.set_ylabel("final evaluation loss (nats/byte)")
  left.set_title("isoFLOP profiles and approach 3's law L(N, D)")
  right.scatter(fit_runs.flops, fit_runs.loss, color="grey", s=18, label="fit runs")
  c_grid = np.geomspace(fit_runs.flops.min(), HELD_OUT_BUDGET * 1.5, 60)
  frontier = [fit3.loss_at(n, d) for n, d in zip(fit3.frontier.predict_n(c_grid),
                                                fit3.frontier.predict_d(c_grid))]
  right.plot(c_grid, [e.value for e in frontier], color="black", lw=1.2,
             label="fitted compute-optimal loss")
  right.fill_between(c_grid, [e.low for e in frontier], [e.high for e in frontier],
                     color="black", alpha=0.1)
  right.axvline(max(FIT_BUDGETS), color="grey", ls=":", lw=1)
  right.set_xscale("log")
  budgets_shown = list(FIT_BUDGETS) + [HELD_OUT_BUDGET]
  right.set_xticks(budgets_shown, [f"{b:.2g}" for b in budgets_shown])
  right.set_xlabel("training FLOPs C")
  right.set_ylabel("final evaluation loss (nats/byte)")
  right.set_title(f"held-out run at {HELD_OUT_BUDGET:.2g} FLOPs: error "
                  f"{100 * held['relative_error']:+.1f}%")
  for ax in (left, right):
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=200)
  plt.close(fig)
  return path


def write_csv(rows: Sequence[Dict[str, str]], roles: Sequence[str],
              fit3: scaling_laws.ParametricFit, path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    for row, role in zip(rows, roles):
      fitted = fit3.loss_at(float(row["params"]), float(row["tokens"]))
      writer.writerow(dict(row, role=role, fitted_loss=f"{fitted.value:.4f}",
                           fitted_low=f"{fitted.low:.4f}", fitted_high=f"{fitted.high:.4f}"))


def summary_markdown(result: Dict[str, object]) -> str:
  fit3, held = result["approach_3"], result["held_out"]
  p = held["predicted_loss"]
  interval = lambda e: f"{e['value']:.4g} [{e['low']:.4g}, {e['high']:.4g}]"  # noqa: E731
  lines = [
      "| quantity | value [95% interval] |", "| --- | --- |",
      *(f"| {name} | {interval(fit3[name])} |" for name in ("E", "A", "B", "alpha", "beta")),
      f"| approach 3: N_opt at {HELD_OUT_BUDGET:.2g} | {interval(fit3['N_opt'])} |"]
  fit2 = result["approach_2"]
  if isinstance(fit2, dict):
    lines.append(f"| approach 2: N_opt at {HELD_OUT_BUDGET:.2g} | {interval(fit2['N_opt'])} "
                 f"(budgets used: {sum(b['used'] for b in fit2['budgets'])} of "
                 f"{len(fit2['budgets'])}) |")
  else:
    lines.append(f"| approach 2 | not fitted: {fit2} |")
  lines += [
      f"| held-out run | {held['run']}: N = {held['params']:,.0f}, D = {held['tokens']:,.0f}, "
      f"C = {held['flops']:.3g} |",
      f"| forecast loss | {interval(p)} |",
      f"| measured loss | {held['measured_loss']:.4f} |",
      f"| error (measured − forecast) | {held['error']:+.4f} ({100 * held['relative_error']:+.2f}%); "
      f"{'inside' if held['inside_interval'] else 'outside'} the interval |"]
  return "\n".join(lines)


FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string("workdir", "workdirs/scaling_study", "Study directory (fit/, held_out/).")
  flags.DEFINE_integer("replicates", 200, "Bootstrap replicates of each fit.", lower_bound=20)
  flags.DEFINE_string("csv", "benchmarks/results/scaling_study.csv", "Every run, as a CSV.")
  flags.DEFINE_string("json", "benchmarks/results/scaling_study.json", "Fits and forecast.")
  flags.DEFINE_string("figure", "docs/figures/scaling_study.png", "The figure (PNG).")


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  fit_dir = os.path.join(FLAGS.workdir, "fit")
  held_dir = os.path.join(FLAGS.workdir, "held_out")
  sweep(fit_dir, FIT_DESIGN)
  fit_runs = scaling_fit.read_runs(fit_dir)[FAMILY]
  fit2, fit3 = fit(fit_runs, FLAGS.replicates)
  target = fit3.frontier.n_opt.value
  print(f"[study] approach 3 on the fit budgets: N_opt({HELD_OUT_BUDGET:.2g}) = {target:,.0f}; "
        "training the held-out run")
  sweep(held_dir, held_out_design(target))
  held_rows = read_rows(held_dir)
  result = forecast(fit2, fit3, held_rows[0])
  fit_rows = read_rows(fit_dir)
  write_csv(fit_rows + held_rows, ["fit"] * len(fit_rows) + ["held-out"], fit3, FLAGS.csv)
  plot(fit_runs, fit3, result, FLAGS.figure)
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
  with open(FLAGS.json, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  print(summary_markdown(result))
  print(f"[study] wrote {FLAGS.csv}, {FLAGS.json}, {FLAGS.figure}")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
