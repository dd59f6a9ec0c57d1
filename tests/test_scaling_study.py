"""benchmarks/scaling_study.py without its trainings: its analysis on runs drawn from a
known law, so the script that made docs/figures/scaling_study.png cannot rot."""
import csv
import importlib.util
import json
import math
import os
import sys

import numpy as np
import pytest

from launch.scaling import scaling_laws
from launch.sweeps import sweep_design

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "scaling_study.py")
TRUE = dict(E=1.1, A=60.0, B=90.0, alpha=0.3, beta=0.32)


def law(n, d):
  return TRUE["E"] + TRUE["A"] / n ** TRUE["alpha"] + TRUE["B"] / d ** TRUE["beta"]


@pytest.fixture(scope="module")
def study():
  spec = importlib.util.spec_from_file_location("scaling_study", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def _rows(study, rng):
  """sweep.csv-like rows of the study's fit budgets (5 sizes each, 0.3% noise)."""
  rows = []
  for budget in study.FIT_BUDGETS:
    optimum = math.sqrt(budget / 120)
    for factor in np.geomspace(0.25, 4, 5):
      n = optimum * factor
      d = budget / (6 * n)
      rows.append({"run": f"m_C{budget:g}_{n:.0f}", "params": f"{n:.1f}", "tokens": f"{d:.1f}",
                   "flops": f"{budget:g}", "flop_budget": f"{budget:g}",
                   "loss": f"{law(n, d) * math.exp(rng.normal(0, 0.003)):.6f}"})
  return rows


def test_held_out_design_trains_the_target_size(study):
  design = dict(flag[2:].split("=") for flag in study.held_out_design(123_456.0))
  assert design["points_per_budget"] == "1"
  budget, tokens_per_param = float(design["flop_budgets"]), float(design["tokens_per_param"])
  assert budget == study.HELD_OUT_BUDGET
  assert math.sqrt(budget / (6 * tokens_per_param)) == pytest.approx(123_456.0, rel=1e-5)
  run, = sweep_design.plan_isoflop(["mqa"], [budget], points_per_budget=1, spread=4.0,
                            tokens_per_param=tokens_per_param, batch_size=16,
                            sequence_length=64, vocab_size=259, workdir="/tmp/unused")
  assert run.target_params == 123_456


def test_forecast_figure_and_csv_of_runs_from_a_known_law(study, tmp_path):
  # Coverage over seeds is test_scaling_laws' job; this seed's interval holds the truth.
  rows = _rows(study, np.random.default_rng(2))
  fit_runs = scaling_laws.Runs.from_columns(
      *(np.array([float(r[k]) for r in rows]) for k in ("params", "tokens", "loss",
                                                      "flops", "flop_budget")))
  fit2, fit3 = study.fit(fit_runs, replicates=40)
  n = fit3.frontier.n_opt.value
  d = study.HELD_OUT_BUDGET / (6 * n)
  held = {"run": "held", "params": f"{n:.1f}", "tokens": f"{d:.1f}",
          "flops": f"{study.HELD_OUT_BUDGET:g}", "flop_budget": f"{study.HELD_OUT_BUDGET:g}",
          "loss": f"{law(n, d):.6f}"}
  result = study.forecast(fit2, fit3, held)
  forecast = result["held_out"]
  assert forecast["inside_interval"]
  assert forecast["predicted_loss"]["value"] == pytest.approx(law(n, d), rel=0.01)
  assert forecast["error"] == pytest.approx(
      law(n, d) - forecast["predicted_loss"]["value"], abs=1e-6)
  assert result["approach_2"]["N_opt"]["value"] == pytest.approx(n, rel=0.3)
  json.dumps(result)                                   # what --json writes
  figure = study.plot(fit_runs, fit3, result, str(tmp_path / "f" / "study.png"))
  with open(figure, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  study.write_csv(rows + [held], ["fit"] * len(rows) + ["held-out"], fit3,
                  str(tmp_path / "study.csv"))
  with open(tmp_path / "study.csv") as f:
    written = list(csv.DictReader(f))
  assert [r["role"] for r in written] == ["fit"] * 15 + ["held-out"]
  for row in written:
    fitted = fit3.loss_at(float(row["params"]), float(row["tokens"]))
    assert float(row["fitted_loss"]) == pytest.approx(fitted.value, abs=1e-4)
    assert float(row["fitted_low"]) <= float(row["fitted_loss"]) <= float(row["fitted_high"])
  summary = study.summary_markdown(result)
  assert "| measured loss |" in summary and "inside the interval" in summary
