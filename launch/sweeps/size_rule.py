r"""A learning rate that follows the model's size, fitted from a small LR sweep.

  python -m launch.sweep ... --lr_sweep=1e-3,3e-3,1e-2 [--lr_sweep_sizes=2] \
      [--lr_sweep_tokens_per_param=20]

Why: one learning rate for every size makes the fitted exponents partly measure
mistuning (Porian et al. 2024 trace much of the Kaplan-Chinchilla disagreement to
hyper-parameters not tuned per scale); DeepSeek (2024) fit the learning rate as a power
law of scale instead. μP (Yang et al. 2022) would make one rate transfer across widths,
but needs width multipliers in the model's initialisation and per-layer rates in the
optimizer; a fitted rule needs neither and also absorbs what μP leaves out (depth,
the recurrence's own parameters).

Before the study proper, every family trains its `--lr_sweep_sizes` smallest sizes at
each `--lr_sweep` rate (probe runs `<family>_<size>_lr<rate>`, in the study's schedule:
WSD with the design's cooldown, or cosine, to `--lr_sweep_tokens_per_param`). Per
size, the best rate is the vertex of a parabola of the final loss in log rate (the
grid's best rate where the parabola has no minimum inside the grid, reported as not
bracketed). Across sizes, log rate = log c + k·log N by least squares (k = 0 from a
single size). Every run of the study then trains at c·N^k (N: its non-embedding
parameters), and the rule, the probes' losses and the fit go to `size_rule.json`.
The batch is not part of the rule: every run keeps `--batch_size` (at these scales the
runs are far below any critical batch size).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Dict, List, Sequence, Tuple

import numpy as np

from launch.clusters import common
from model import counting

PROBE = "lr_probe"


@dataclasses.dataclass(frozen=True)
class LrRule:
  """lr(N) = coefficient · N^exponent for one family, with the points it was fitted to."""
  family: str
  coefficient: float
  exponent: float
  points: Tuple[dict, ...] = ()

  def __call__(self, params: float) -> float:
    return float(self.coefficient * params ** self.exponent)

  def to_json(self) -> dict:
    return {"rule": "peak_learning_rate = coefficient * N ** exponent (N: non-embedding "
                    "parameters)",
            "coefficient": self.coefficient, "exponent": self.exponent,
            "sizes": list(self.points)}


def parse_rates(texts: Sequence[str]) -> List[float]:
  """--lr_sweep values, ascending. Raises ValueError with the flag's fix."""
  rates = common.positive_numbers(texts, "--lr_sweep", "learning rate", "1e-3,3e-3,1e-2")
  if len(set(rates)) < 2:
    raise ValueError("--lr_sweep needs at least 2 distinct rates (3 or more to bracket "
                     "the best one), e.g. 1e-3,3e-3,1e-2")
  return sorted(set(rates))


def best_rate(rates: Sequence[float], losses: Sequence[float]) -> Tuple[float, bool]:
  """(best rate, bracketed): the vertex of a least-squares parabola of loss in log rate
  when it opens upwards with its vertex inside the grid, else the grid's best rate."""
  x, y = np.log(np.asarray(rates, float)), np.asarray(losses, float)
  best = float(rates[int(np.argmin(y))])
  if len(x) < 3:
    return best, False
  a, b, _ = np.polyfit(x, y, 2)
  if a <= 0:
    return best, False
  vertex = -b / (2 * a)
  if not x.min() < vertex < x.max():
    return best, False
  return float(np.exp(vertex)), True


def fit_rule(family: str, sizes: Sequence[Tuple[int, Sequence[float], Sequence[float]]]
             ) -> LrRule:
  """The family's rule from (N, rates, final losses) per probed size."""
  points, logs_n, logs_lr = [], [], []
  for params, rates, losses in sizes:
    rate, bracketed = best_rate(rates, losses)
    points.append({"params": params, "best_learning_rate": rate, "bracketed": bracketed,
                   "rates": list(rates), "losses": list(losses)})
    logs_n.append(math.log(params))
    logs_lr.append(math.log(rate))
  if len(set(logs_n)) < 2:   # one size: its best rate for every size
    return LrRule(family, points[0]["best_learning_rate"], 0.0, tuple(points))
  exponent, intercept = np.polyfit(logs_n, logs_lr, 1)
  return LrRule(family, float(np.exp(intercept)), float(exponent), tuple(points))


def plan_probes(sizes: Sequence, rates: Sequence[float], *, count: int, workdir: str,
                extra_gin: Tuple[str, ...] = ()) -> list:
  """The probe runs: of `sizes` (`launch.sweeps.sweep_design.Run`s of one family and size each, at
  the probes' tokens per parameter), each family's `count` smallest at every rate."""
  probes = []
  for family in dict.fromkeys(run.family for run in sizes):
    members = sorted((run for run in sizes if run.family == family),
                     key=lambda run: run.target_params)[:count]
    for run in members:
      for rate in rates:
        name = f"{run.family}_{run.size}_lr{rate:g}"
        probes.append(dataclasses.replace(
            run, peak_learning_rate=rate, role=PROBE, label=name, extra_gin=extra_gin,
            workdir=os.path.join(workdir, "runs", name)))
  return probes


def fit_rules(probes: Sequence) -> Dict[str, LrRule]:
  """Per family, the rule from finished probes (`eval_loss` collected)."""
  rules = {}
  for family in dict.fromkeys(p.family for p in probes):
    by_size: Dict[str, list] = {}
    for probe in probes:
      if probe.family == family:
        by_size.setdefault(probe.size, []).append(probe)
    sizes = [(counting.analytic_param_counts(members[0].config).non_embedding,
              [m.peak_learning_rate for m in members], [m.eval_loss for m in members])
             for members in by_size.values()]
    rules[family] = fit_rule(family, sizes)
  return rules


def warnings(rules: Dict[str, LrRule]) -> List[str]:
  """One line per probed size whose best rate lies at the grid's edge."""
  return [f"[sweep] {family}: the best learning rate at {p['params']:,} parameters is at "
          f"the edge of --lr_sweep ({p['best_learning_rate']:.3g}); widen the grid"
          for family, rule in rules.items() for p in rule.points if not p["bracketed"]]


def rules_json(rules: Dict[str, LrRule], rates: Sequence[float], count: int,
               tokens_per_param: float, parametrization: str = "standard") -> str:
  """The study's `size_rule.json`; under μP (`parametrization` as
  `model.config.describe_parametrization` writes it) one probed size, exponent 0."""
  return json.dumps({"method": "lr_sweep", "parametrization": parametrization,
                     "rates": list(rates), "sizes_per_family": count,
                     "tokens_per_param": tokens_per_param,
                     "families": {f: r.to_json() for f, r in rules.items()}}, indent=2)
