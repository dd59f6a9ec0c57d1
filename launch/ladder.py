"""The ladder: train the model a study's fit recommends for a larger budget, and score
the forecast.

  python -m launch.sweep --train_optimum=1e13 --workdir=STUDY [the study's flags] \
      [--metric=loss|bits_per_byte] [--replicates=200]

Why: a study is only useful if it forecasts the next, larger run. For each family,
approach 3 (`launch.scaling_laws.fit_parametric`) is fitted to the study's finished
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

import json
import math
from typing import Dict, Optional, Sequence, Tuple

from launch import scaling_fit
from launch import scaling_laws
from launch import size_rule
from pretrain import flops as flops_lib
from pretrain import storage
from pretrain.errors import usage_error

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


def plan_optimum(study_dir: str, family: str, budget: float, *, metric: str,
                 replicates: int, batch_size: int, sequence_length: int, vocab_size: int,
                 warmup_fraction: float, peak_learning_rate: Optional[float],
                 record: bool = True):
  """The `launch.sweep.Run` of the compute-optimal model at `budget`, and its forecast
  (the one already on disk if the run was planned before; written there if `record`,
  which a dry run is not)."""
  from launch import sweep  # the Run and size rule live there; it imports this module
  families = scaling_fit.read_runs(study_dir, metric)
  if family not in families:
    raise usage_error(f"--train_optimum: the study in {study_dir} has no finished {family} "
                      f"runs; finish the study first or drop {family} from --families")
  name = f"{family}_optimum_C{sweep.budget_label(budget)}"
  workdir = storage.join(study_dir, "ladder", name)
  forecast = _study_json(workdir, FORECAST)
  if forecast is None:
    try:
      fit = scaling_laws.fit_parametric(families[family], budget, replicates=replicates)
    except ValueError as error:
      raise usage_error(f"--train_optimum: cannot fit approach 3 to {family}: {error}; "
                        "the study needs more finished runs") from None
    n_opt = fit.frontier.n_opt
  else:
    n_opt = scaling_laws.Estimate(**forecast["n_opt"])
  config = sweep.config_for_size(family, max(1000, int(round(n_opt.value))), vocab_size,
                                 sequence_length)
  per_step = flops_lib.training_flops_per_token(config, sequence_length) * (
      batch_size * sequence_length)
  steps = max(1, int(round(budget / per_step)))
  params = sweep.non_embedding_params(config)
  run = sweep.Run(family, sweep.size_label(n_opt.value), int(round(n_opt.value)), config,
                  steps, batch_size, sequence_length, workdir,
                  warmup_steps=int(math.ceil(warmup_fraction * steps)),
                  peak_learning_rate=study_learning_rate(study_dir, family, params,
                                                         peak_learning_rate),
                  flop_budget=float(budget), role="optimum", label=name,
                  extra_gin=schedule_bindings(study_dir))
  if forecast is None:
    predicted = fit.loss_at(params, run.tokens)
    forecast = {"family": family, "flop_budget": budget, "metric": metric,
                "n_opt": n_opt.to_json(), "params": params, "tokens": run.tokens,
                "flops": run.flops, "peak_learning_rate": run.peak_learning_rate,
                "predicted": predicted.to_json(), "fit": fit.to_json()}
    if record:
      storage.write_text(storage.join(workdir, FORECAST), json.dumps(forecast, indent=2))
  return run, forecast


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


def plan_all(study_dir: str, families: Sequence[str], budget: float, **kwargs):
  """`plan_optimum` for every family: the runs and their forecasts by run name."""
  runs, forecasts = [], {}
  for family in families:
    run, forecast = plan_optimum(study_dir, family, budget, **kwargs)
    runs.append(run)
    forecasts[run.name] = forecast
  return runs, forecasts
