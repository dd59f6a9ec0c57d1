"""The three Chinchilla approaches recover a known law: synthetic runs drawn from
L(N, D) = E + A/N^α + B/D^β with log-normal noise, 50 seeds per approach; each
approach's 95% bootstrap interval must hold the truth in at least 90% of them."""

import numpy as np
import pytest

from launch.scaling import scaling_laws

TRUE = dict(E=1.8, A=400.0, B=410.0, alpha=0.34, beta=0.28)
A_TRUE = TRUE["beta"] / (TRUE["alpha"] + TRUE["beta"])   # N_opt ∝ C^a
B_TRUE = TRUE["alpha"] / (TRUE["alpha"] + TRUE["beta"])  # D_opt ∝ C^b
G_TRUE = (TRUE["alpha"] * TRUE["A"] / (TRUE["beta"] * TRUE["B"])) ** (
    1 / (TRUE["alpha"] + TRUE["beta"]))
SEEDS = range(50)
NOISE = 0.01   # relative, per run


def law(n, d):
  return TRUE["E"] + TRUE["A"] / n ** TRUE["alpha"] + TRUE["B"] / d ** TRUE["beta"]


def true_n_opt(flops):
  return G_TRUE * (flops / 6) ** A_TRUE


def isoflop_runs(seed, budgets=np.geomspace(1e17, 1e20, 5), points=7):
  """Sizes spread x4 either side of the true optimum of each budget, D = C / 6N."""
  rng = np.random.default_rng(seed)
  n = np.concatenate([true_n_opt(c) * np.geomspace(0.25, 4, points) for c in budgets])
  c = np.repeat(budgets, points)
  d = c / (6 * n)
  loss = law(n, d) * np.exp(rng.normal(0, NOISE, len(n)))
  return scaling_laws.Runs.from_columns(n, d, loss, budget=c)


def curve_runs(seed, sizes=np.geomspace(1e7, 1e9, 16), points=40):
  """Runs of 16 sizes, each with a training curve out to 200 tokens per parameter."""
  rng = np.random.default_rng(seed)
  curves, final = [], []
  for n in sizes:
    d = np.geomspace(n / 5, 200 * n, points)
    loss = law(n, d) * np.exp(rng.normal(0, NOISE / 4, points))
    curves.append((d, loss))
    final.append((n, d[-1], loss[-1]))
  n, d, loss = map(np.array, zip(*final))
  return scaling_laws.Runs.from_columns(n, d, loss, curves=curves)


def coverage(fits, truth, name):
  covered = [getattr(f, name).covers(truth) for f in fits]
  return sum(covered) / len(covered)


def test_approach_2_intervals_cover_the_true_exponents():
  fits = [scaling_laws.fit_isoflop(isoflop_runs(seed), 1e21, replicates=200, seed=seed)
          for seed in SEEDS]
  assert coverage(fits, A_TRUE, "a") >= 0.9
  assert coverage(fits, B_TRUE, "b") >= 0.9
  assert coverage(fits, true_n_opt(1e21), "n_opt") >= 0.9
  assert np.median([f.a.value for f in fits]) == pytest.approx(A_TRUE, abs=0.01)


def test_approach_1_intervals_cover_the_true_exponents():
  fits = [scaling_laws.fit_envelope(curve_runs(seed), 1e20, replicates=200, seed=seed)
          for seed in SEEDS]
  assert coverage(fits, A_TRUE, "a") >= 0.9
  assert coverage(fits, B_TRUE, "b") >= 0.9


@pytest.mark.slow
def test_approach_3_intervals_cover_the_true_parameters():
  fits = [scaling_laws.fit_parametric(isoflop_runs(seed), 1e21, replicates=100, seed=seed)
          for seed in SEEDS]
  for name, truth in TRUE.items():
    covered = [f.params[name].covers(truth) for f in fits]
    assert sum(covered) >= 0.9 * len(fits), (name, sum(covered))
  assert coverage([f.frontier for f in fits], A_TRUE, "a") >= 0.9
  # A held-out run 10x beyond the largest budget, off the optimum: its loss interval.
  n = 1.5 * true_n_opt(1e21)
  d = 1e21 / (6 * n)
  assert sum(f.loss_at(n, d).covers(law(n, d)) for f in fits) >= 0.9 * len(fits)


def test_loss_at_is_the_percentile_interval_of_the_refits():
  """`loss_at` against a direct evaluation of every refit's law at (N, D)."""
  fit = scaling_laws.fit_parametric(isoflop_runs(3), 1e21, replicates=40, seed=3)
  thetas = fit.replicate_thetas
  assert thetas.shape == (40, 5)
  for n, d in [(3e8, 2e10), (1e10, 5e11)]:
    losses = [np.exp(e) + np.exp(a) / n ** alpha + np.exp(b) / d ** beta
              for e, a, b, alpha, beta in thetas]
    estimate = fit.loss_at(n, d)
    assert estimate.value == pytest.approx(float(fit.predict(n, d)), rel=1e-12)
    assert (estimate.low, estimate.high) == pytest.approx(
        tuple(np.percentile(losses, [2.5, 97.5])), rel=1e-12)
    assert estimate.low < estimate.value < estimate.high
  # At the compute-optimal point it is the reported loss at the target.
  n_opt, d_opt = fit.frontier.n_opt.value, fit.frontier.d_opt.value
  assert fit.loss_at(n_opt, d_opt).value == pytest.approx(fit.loss_at_target.value, rel=1e-9)
