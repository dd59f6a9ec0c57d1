"""Scaling-law fits recover known power laws; plots and tables are written."""
import numpy as np
import pytest

from launch import scaling_fit


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
