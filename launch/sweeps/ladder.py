r"""The ladder: train the model a study's fit recommends for a larger budget, and score
the forecast.

  python -m launch.sweep --train_optimum=1e13 --workdir=STUDY [the study's flags] \
      [--metric=loss|bits_per_byte] [--replicates=200]

Why: a study is only useful if it forecasts the next, larger run. For each family,
approach 3 (`launch.scaling.scaling_laws.fit_parametric`) is fitted to the study's finished
runs (`launch.scaling_fit.read_runs`: a forked study's cooldown end-points), its
compute-optimal N_opt at C becomes a model by the size rule, trained for the steps
that spend C (the trainer's FLOPs count), in the study's schedule (WSD with its
cooldown when the study was forked, `design.json`) and at its learning rate (the
study's `size_rule.json` rule when there is one). The fitted loss at that run's actual
N and D, with the interval of the bootstrap refits, is written to the run's
`forecast.json` before it trains, and never recomputed: a resumed ladder scores the
forecast made before the run, not one refitted after. When the run has finished, its
measured loss, the error and whether the interval holds it are added to the file and
printed.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Dict, Optional, Tuple

from launch.scaling import scaling_fit
from launch.scaling import scaling_laws
from launch.sweeps import size_rule
from model import counting
from plumbing import storage
from plumbing.errors import usage_error

FORECAST = "forecast.json"


def _study_json(study_dir: str, name: str) -> Optional[dict]:
  path = storage.join(study_dir, name)
  return json.loads(storage.read_text(path)) if storage.exists(path) else None


def schedule_bindings(study_dir: str) -> Tuple[str, ...]:
  """The study's schedule for a single run: WSD with its cooldown when it was forked."""
  design = _study_json(study_dir, "design.json")
  if not design:
    return ()
  options = design["options"]
  return ("OptimizerConfig.schedule = 'wsd'",
          f"OptimizerConfig.cooldown_shape = {options['cooldown_shape']!r}",
          f"OptimizerConfig.cooldown_fraction = {options['cooldown_fraction']!r}")


def study_learning_rate(study_dir: str, family: str, params: int,
                        default: Optional[float]) -> Optional[float]:
  """The rate the study's size rule gives `params`, else `default`."""
  record = _study_json(study_dir, "size_rule.json")
  if not record or family not in record["families"]:
    return default
  rule = record["families"][family]
  return size_rule.LrRule(family, rule["coefficient"], rule["exponent"])(params)


def optimum_size(study_dir: str, name: str, family: str, budget: float, *, metric: str,
                 replicates: int) -> Tuple[scaling_laws.Estimate, Optional[dict],
                                           Optional[scaling_laws.ParametricFit]]:
  """Approach 3's N_opt at `budget` for `family`, and either the forecast already made
  for the run `name` (a resumed ladder: nothing is refitted) or the fit to make it
  with."""
  forecast = _study_json(run_dir(study_dir, name), FORECAST)
  if forecast is not None:
    return scaling_laws.Estimate(**forecast["n_opt"]), forecast, None
  families = scaling_fit.read_runs(study_dir, metric)
  if family not in families:
    raise usage_error(f"--train_optimum: the study in {study_dir} has no finished {family} "
                      f"runs; finish the study first or drop {family} from --families")
  try:
    fit = scaling_laws.fit_parametric(families[family], budget, replicates=replicates)
  except ValueError as error:
    raise usage_error(f"--train_optimum: cannot fit approach 3 to {family}: {error}; "
                      "the study needs more finished runs") from None
  return fit.frontier.n_opt, None, fit


def run_dir(study_dir: str, name: str) -> str:
  return storage.join(study_dir, "ladder", name)


def ladder_run(base, study_dir: str, name: str, default_rate: Optional[float]):
  """`base` (the `launch.sweeps.sweep_design.Run` that spends the budget at N_opt) as the ladder's
  run: its own directory, the study's schedule and learning rate."""
  params = counting.analytic_param_counts(base.config).non_embedding
  return dataclasses.replace(
      base, role="optimum", label=name, workdir=run_dir(study_dir, name),
      extra_gin=schedule_bindings(study_dir),
      peak_learning_rate=study_learning_rate(study_dir, base.family, params, default_rate))


def make_forecast(run, fit: scaling_laws.ParametricFit, n_opt: scaling_laws.Estimate,
                  metric: str, record: bool) -> Dict[str, object]:
  """The fit's loss at the run's actual N and D with its interval; written beside the
  run if `record` (a dry run does not)."""
  params = counting.analytic_param_counts(run.config).non_embedding
  forecast = {"family": run.family, "flop_budget": run.flop_budget, "metric": metric,
              "n_opt": n_opt.to_json(), "params": params, "tokens": run.tokens,
              "flops": run.flops, "peak_learning_rate": run.peak_learning_rate,
              "predicted": fit.loss_at(params, run.tokens).to_json(), "fit": fit.to_json()}
  if record:
    storage.write_text(storage.join(run.workdir, FORECAST), json.dumps(forecast, indent=2))
  return forecast


def score(run, forecast: Dict[str, object], metric: str) -> Dict[str, object]:
  """The forecast with the finished run's measured value, error and coverage added
  (written beside the run)."""
  measured = run.eval_loss if metric == "loss" else run.eval_bits_per_byte
  if measured is None:
    raise usage_error(f"--train_optimum: {run.name} has no final {metric}; "
                      "fit --metric=loss instead")
  predicted = scaling_laws.Estimate(**forecast["predicted"])
  scored = dict(forecast, measured=measured, error=measured - predicted.value,
                relative_error=(measured - predicted.value) / measured,
                inside_interval=predicted.covers(measured))
  storage.write_text(storage.join(run.workdir, FORECAST), json.dumps(scored, indent=2))
  return scored


def report_line(name: str, scored: Dict[str, object]) -> str:
  p = scored["predicted"]
  return (f"[ladder] {name}: forecast {p['value']:.4f} [{p['low']:.4f}, {p['high']:.4f}], "
          f"measured {scored['measured']:.4f}, error {scored['error']:+.4f} "
          f"({100 * scored['relative_error']:+.2f}%), "
          f"{'inside' if scored['inside_interval'] else 'outside'} the interval")
