"""Scaling-law fits recover known power laws; plots and tables are written; the
`launch.scaling_fit` command fits the three approaches from a CSV."""
import csv
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from launch.scaling import scaling_fit
from launch.scaling import scaling_laws
from plumbing import storage
from tiers import slow_after_first


def synthetic_points(e, a, alpha, n=7, noise=0.0, seed=0):
  flops = np.geomspace(1e12, 1e17, n)
  losses = e + a * flops ** -alpha
  losses *= np.exp(np.random.default_rng(seed).normal(0, noise, n))
  return flops, losses


def test_full_form_recovers_known_law():
  flops, losses = synthetic_points(e=1.7, a=450.0, alpha=0.2, noise=0.003)
  fit = scaling_fit.fit_scaling_law(flops, losses)
  assert fit.form == scaling_fit.FULL_FORM
  assert fit.alpha == pytest.approx(0.2, abs=0.03)
  assert fit.E == pytest.approx(1.7, abs=0.1)
  assert fit.alpha_err is not None and 0 < fit.alpha_err < 0.05
  # The truth lies within a few standard errors.
  assert abs(fit.alpha - 0.2) < 4 * fit.alpha_err + 1e-3


def test_exact_law_is_recovered_exactly():
  flops, losses = synthetic_points(e=2.0, a=1e3, alpha=0.25, n=6)
  fit = scaling_fit.fit_scaling_law(flops, losses)
  assert fit.alpha == pytest.approx(0.25, rel=1e-3)
  assert fit.A == pytest.approx(1e3, rel=1e-2)
  np.testing.assert_allclose(fit.predict(flops), losses, rtol=1e-5)


def test_three_points_fit_the_floor_free_power_law_with_uncertainty():
  flops, losses = synthetic_points(e=0.0, a=80.0, alpha=0.12, n=3, noise=0.002, seed=1)
  fit = scaling_fit.fit_scaling_law(flops, losses)
  assert fit.form == scaling_fit.POWER_FORM and fit.E == 0.0 and fit.E_err is None
  assert fit.alpha == pytest.approx(0.12, abs=0.01)
  assert fit.alpha_err is not None and fit.A_err is not None


def test_full_form_with_too_few_points_reports_no_uncertainty():
  flops, losses = synthetic_points(e=1.0, a=100.0, alpha=0.2, n=3)
  fit = scaling_fit.fit_scaling_law(flops, losses, with_floor=True)
  assert fit.alpha_err is None


@pytest.mark.parametrize("flops, losses, message", [
    ([1e12], [2.0], "at least 2"),
    ([1e12, 1e13], [2.0, -1.0], "positive"),
    ([1e12, 1e12], [2.0, 1.9], "different compute"),
    ([1e12, 1e13, 1e14], [2.0, 1.9], "same length"),
])
def test_bad_inputs_name_the_problem(flops, losses, message):
  with pytest.raises(ValueError, match=message):
    scaling_fit.fit_scaling_law(flops, losses)


def test_plot_and_table(tmp_path):
  points, fits = {}, {}
  for family, alpha in (("hawk", 0.1), ("mqa", 0.15)):
    flops, losses = synthetic_points(e=0.0, a=50.0, alpha=alpha, n=3)
    points[family] = (flops, losses)
    fits[family] = scaling_fit.fit_scaling_law(flops, losses)
  path = tmp_path / "scaling.png"
  scaling_fit.plot_scaling(points, fits, str(path))
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  table = scaling_fit.fit_table_markdown(fits)
  assert table.count("\n") == 3 and "| hawk |" in table and "0.15" in table


# -- The command line: all three approaches from a CSV ----------------------------------------
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_runs_csv(path, with_flops):
  """Two families on an isoFLOP design drawn from known laws (the CSV a user brings)."""
  rng = np.random.default_rng(0)
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["family", "params", "tokens", "loss"] + (["flops"] if with_flops else []))
    for family, e in (("hawk", 1.8), ("mqa", 2.0)):
      for budget in np.geomspace(1e17, 1e19, 4):
        n_opt = 0.6 * (budget / 6) ** 0.45
        for n in n_opt * np.geomspace(0.25, 4, 6):
          d = budget / (6 * n)
          loss = (e + 400 / n ** 0.34 + 410 / d ** 0.28) * math.exp(rng.normal(0, 0.005))
          writer.writerow([family, n, d, loss] + ([7 * n * d] if with_flops else []))
    writer.writerow(["hawk", 1e8, 1e9, ""])   # an unfinished run: skipped


@pytest.mark.slow
def test_cli_fits_all_three_approaches_with_intervals_and_plots(tmp_path):
  path = tmp_path / "runs.csv"
  _write_runs_csv(path, with_flops=False)
  result = subprocess.run(
      [sys.executable, "-m", "launch.scaling_fit", f"--runs={path}", "--approach=all",
       "--json", "--target_flops=1e21", f"--plots={tmp_path / 'plots'}", "--replicates=40"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  out = json.loads(result.stdout)
  assert set(out) == {"hawk", "mqa"} and out["hawk"]["runs"] == 24
  for family in out.values():
    for approach in ("approach_1", "approach_2", "approach_3"):
      fit = family[approach]
      assert fit["target_flops"] == 1e21
      for key in ("a", "b", "N_opt", "D_opt"):
        assert fit[key]["low"] <= fit[key]["value"] <= fit[key]["high"], (approach, key)
    third = family["approach_3"]
    assert third["alpha"]["value"] == pytest.approx(0.34, abs=0.04)  # coverage: test_scaling_laws
    assert third["flops_per_param_token"] == pytest.approx(6.0)
    assert 0.4 < family["approach_2"]["a"]["value"] < 0.5
  for name in ("loss_vs_compute", "isoflop_hawk", "contours_mqa"):
    assert (tmp_path / "plots" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_uses_the_flops_column_for_the_frontier(tmp_path):
  path = tmp_path / "runs.csv"
  _write_runs_csv(path, with_flops=True)
  result = subprocess.run(
      [sys.executable, "-m", "launch.scaling_fit", f"--runs={path}", "--approach=3",
       "--replicates=20"], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert "| 3: parametric L(N, D) |" in result.stdout and "### mqa" in result.stdout
  assert "alpha = 0.3" in result.stdout


@pytest.mark.parametrize("content, flags, fragment", slow_after_first([
    ("params,tokens\n1,2\n", [], "has no column loss"),
    ("params,tokens,loss\n1e6,2e7,x\n", [], "could not convert"),
    ("params,tokens,loss\n1e6,2e7,-1\n", [], "positive"),
    # A sweep.csv written before bits per byte were recorded.
    ("params,tokens,loss\n1e6,2e7,2.0\n", ["--metric=bits_per_byte"],
     "has no column bits_per_byte"),
]))
def test_cli_bad_csv_is_one_line_and_exit_code_2(tmp_path, content, flags, fragment):
  path = tmp_path / "runs.csv"
  path.write_text(content)
  result = subprocess.run([sys.executable, "-m", "launch.scaling_fit", f"--runs={path}",
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, (result.stdout, result.stderr)
  errors = [l for l in result.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1 and fragment in errors[0], result.stderr


BYTES_PER_TOKEN = 3.5   # the study's text: bits per byte = loss / (ln 2 · 3.5)


def _write_study(root, workdir_base):
  """sweep.csv and each run's metrics.jsonl under `root`; the CSV names each run's
  workdir under `workdir_base` (where the study will be read from). Bits per byte are
  the loss over a constant bytes per token."""
  sizes = np.geomspace(1e6, 1e8, 8)
  per_byte = lambda loss: loss / (math.log(2) * BYTES_PER_TOKEN)  # noqa: E731
  with open(root / "sweep.csv", "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["run", "family", "params", "tokens", "flops", "loss", "bits_per_byte",
                     "train_steps", "workdir"])
    for i, n in enumerate(sizes):
      run_dir = root / "runs" / f"hawk_{i}"
      run_dir.mkdir(parents=True)
      steps, tokens_per_step = 100, 200 * n / 100
      with open(run_dir / "metrics.jsonl", "w") as metrics:
        for step in range(10, steps + 1, 10):
          d = step * tokens_per_step
          loss = 1.8 + 400 / n ** 0.34 + 410 / d ** 0.28
          metrics.write(json.dumps({"step": step, "loss": 9.0}) + "\n")
          metrics.write(json.dumps({"step": step, "eval_loss": loss,
                                    "eval_bits_per_byte": per_byte(loss)}) + "\n")
        metrics.write('{"step": 101, "eval')          # cut short by a kill
      d = steps * tokens_per_step
      loss = 1.8 + 400 / n ** 0.34 + 410 / d ** 0.28
      writer.writerow([f"hawk_{i}", "hawk", n, d, 6 * n * d, loss, per_byte(loss), steps,
                       f"{workdir_base}/runs/hawk_{i}"])


def test_study_directory_gives_approach_1_the_training_curves(tmp_path):
  """sweep.csv plus each run's metrics.jsonl: every eval row becomes a curve point."""
  _write_study(tmp_path, str(tmp_path))
  families = scaling_fit.read_runs(str(tmp_path))
  runs = families["hawk"]
  assert runs.curves is not None and all(len(c[0]) == 10 for c in runs.curves)
  np.testing.assert_allclose(runs.curves[0][0][-1], runs.tokens[0])
  fit = scaling_laws.fit_envelope(runs, 1e20, replicates=20)
  assert len(fit.details["envelope"]) >= 5           # curves, not 8 final points
  assert fit.a.value == pytest.approx(0.28 / 0.62, abs=0.08)   # beta / (alpha + beta)


@pytest.mark.slow   # fast tier under 5 min: a study's CLI fit (8 s)
def test_cli_fits_bits_per_byte_of_a_study(tmp_path):
  """`--metric=bits_per_byte` fits the bits_per_byte column and the runs'
  eval_bits_per_byte curves. Here they are the loss over a constant bytes per token, a
  rescaling that leaves the compute-optimal allocation, approach 1's exponent, as is."""
  _write_study(tmp_path, str(tmp_path))
  by_loss, by_byte = (scaling_fit.read_runs(str(tmp_path), metric)["hawk"]
                      for metric in ("loss", "bits_per_byte"))
  scale = math.log(2) * BYTES_PER_TOKEN
  np.testing.assert_allclose(by_byte.loss, by_loss.loss / scale)
  np.testing.assert_allclose(by_byte.curves[3][1], by_loss.curves[3][1] / scale)
  result = subprocess.run(
      [sys.executable, "-m", "launch.scaling_fit", f"--runs={tmp_path}",
       "--metric=bits_per_byte", "--approach=1", "--json", "--replicates=20",
       f"--plots={tmp_path / 'plots'}"], cwd=REPO, capture_output=True, text=True,
      timeout=300)
  assert result.returncode == 0, result.stderr
  fit = json.loads(result.stdout)["hawk"]["approach_1"]
  expected = scaling_laws.fit_envelope(by_loss, float(by_loss.flops.max()), replicates=20)
  assert fit["a"]["value"] == pytest.approx(expected.a.value, rel=1e-6)
  assert (tmp_path / "plots" / "loss_vs_compute.png").exists()


def test_study_and_plots_in_a_bucket(tmp_path, s3_bucket):
  """A study whose sweep.csv and run workdirs are in a bucket reads as the local one,
  and the figures are uploaded to a bucket `--plots` directory."""
  bucket = f"{s3_bucket}/study-{tmp_path.name}"
  local = tmp_path / "local"
  local.mkdir()
  _write_study(local, bucket)
  storage.upload_tree(str(local), bucket)
  runs = scaling_fit.read_runs(bucket)["hawk"]
  assert runs.curves is not None and all(len(c[0]) == 10 for c in runs.curves)
  np.testing.assert_allclose(runs.curves[0][0][-1], runs.tokens[0])
  paths = scaling_fit.write_plots({"hawk": runs}, {}, {}, f"{bucket}/plots")
  assert paths == {"loss_vs_compute": f"{bucket}/plots/loss_vs_compute.png"}
  assert storage.read_bytes(paths["loss_vs_compute"])[:8] == b"\x89PNG\r\n\x1a\n"
