"""Optimizer: schedule values, the weight-decay mask on the real model tree, accumulation."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from model.config import ModelConfig
from model.lm import LanguageModel, init_params
from pretrain import optimizer as opt_lib
from pretrain import losses
from pretrain import steps
from sharding import partition


def test_schedule_warmup_peak_cosine_floor():
  config = opt_lib.OptimizerConfig(peak_learning_rate=1e-3, warmup_steps=10,
                                   final_learning_rate_fraction=0.1)
  schedule = opt_lib.learning_rate_schedule(config, total_steps=110)
  assert float(schedule(0)) == 0.0
  np.testing.assert_allclose(float(schedule(5)), 5e-4, rtol=1e-6)
  np.testing.assert_allclose(float(schedule(10)), 1e-3, rtol=1e-6)
  # Halfway through the cosine: floor + (peak - floor) / 2.
  np.testing.assert_allclose(float(schedule(60)), 1e-4 + 0.5 * 9e-4, rtol=1e-5)
  np.testing.assert_allclose(float(schedule(110)), 1e-4, rtol=1e-5)
  values = [float(schedule(s)) for s in range(10, 111)]
  assert all(a >= b for a, b in zip(values, values[1:])), "cosine part must not increase"


def test_schedule_short_run_still_reaches_peak():
  config = opt_lib.OptimizerConfig(peak_learning_rate=2e-3, warmup_steps=1000)
  schedule = opt_lib.learning_rate_schedule(config, total_steps=20)
  np.testing.assert_allclose(float(schedule(20)), 2e-3, rtol=1e-6)


def _wsd_reference(step, *, peak, warmup, total, fraction, final, shape):
  """WSD written out by hand, in float64, for the tests below."""
  start = total - min(round(fraction * total), total - min(warmup, total))
  if step < warmup:
    return peak * step / warmup
  if step < start:
    return peak
  progress = min(1.0, (step - start) / max(total - start, 1))
  left = 1 - (progress if shape == "linear" else progress ** 0.5)
  return peak * (final + (1 - final) * left)


@pytest.mark.parametrize("shape", ["linear", "1-sqrt"])
def test_wsd_schedule_matches_the_hand_computed_curve(shape):
  config = opt_lib.OptimizerConfig(peak_learning_rate=2e-3, warmup_steps=10,
                                   final_learning_rate_fraction=0.1, schedule="wsd",
                                   cooldown_fraction=0.25, cooldown_shape=shape)
  schedule = opt_lib.learning_rate_schedule(config, total_steps=100)
  assert opt_lib.cooldown_start(config, 100) == 75
  for step in range(0, 106):
    expected = _wsd_reference(step, peak=2e-3, warmup=10, total=100, fraction=0.25,
                              final=0.1, shape=shape)
    np.testing.assert_allclose(float(schedule(step)), expected, rtol=1e-6, err_msg=step)
  # Spot values: half-way through the cooldown.
  half = 2e-3 * (0.1 + 0.9 * (0.5 if shape == "linear" else 1 - 0.5 ** 0.5))
  np.testing.assert_allclose(float(schedule(87.5)), half, rtol=1e-6)
  np.testing.assert_allclose(float(schedule(100)), 2e-4, rtol=1e-6)


def test_wsd_without_cooldown_stays_at_the_peak():
  config = opt_lib.OptimizerConfig(peak_learning_rate=1e-3, warmup_steps=4, schedule="wsd",
                                   cooldown_fraction=0.0)
  schedule = opt_lib.learning_rate_schedule(config, total_steps=50)
  assert opt_lib.cooldown_start(config, 50) == 50
  np.testing.assert_allclose([float(schedule(s)) for s in (4, 30, 50)], 1e-3, rtol=1e-7)


def test_wsd_cooldown_never_eats_the_warmup():
  config = opt_lib.OptimizerConfig(warmup_steps=8, schedule="wsd", cooldown_fraction=0.9)
  assert opt_lib.cooldown_start(config, 10) == 8


def test_wsd_fork_from_a_stable_checkpoint_continues_the_unforked_run():
  """A stable run (no cooldown) to step S, whose optimizer state is handed to a run
  of T steps that cools down from S (what launch.sweeps.wsd_design's forks do through the
  checkpoint), gives bit for bit the parameters and learning rates of one run trained
  to T with the same cooldown."""
  fork = opt_lib.OptimizerConfig(peak_learning_rate=0.05, warmup_steps=3, schedule="wsd",
                                 cooldown_fraction=0.3, cooldown_shape="1-sqrt",
                                 weight_decay=0.1)
  stable = dataclasses.replace(fork, cooldown_fraction=0.0)
  total = 20
  start = opt_lib.cooldown_start(fork, total)
  assert start == 14
  target = jnp.linspace(-1.0, 1.0, 6)
  grad_fn = jax.jit(jax.grad(lambda p, k: jnp.sum((p["w"] * k - target) ** 2)))

  def train(tx, schedule, params, state, first, last):
    curve = []
    for step in range(first, last):
      scale = 1.0 + 0.1 * step       # a different "batch" every step, by global step
      updates, state = tx.update(grad_fn(params, scale), state, params)
      params = optax.apply_updates(params, updates)
      curve.append((float(schedule(step)), np.asarray(params["w"])))
    return params, state, curve

  params = {"w": jnp.zeros(6)}
  tx_full = opt_lib.make_optimizer(fork, total)
  _, _, unforked = train(tx_full, opt_lib.learning_rate_schedule(fork, total), params,
                         tx_full.init(params), 0, total)
  tx_stable = opt_lib.make_optimizer(stable, 50)   # the stable run is longer: no matter
  p_s, s_s, stable_curve = train(tx_stable, opt_lib.learning_rate_schedule(stable, 50),
                                 params, tx_stable.init(params), 0, start)
  _, _, forked = train(tx_full, opt_lib.learning_rate_schedule(fork, total), p_s, s_s,
                       start, total)
  for (lr_a, w_a), (lr_b, w_b) in zip(unforked, stable_curve + forked):
    assert lr_a == lr_b
    np.testing.assert_array_equal(w_a, w_b)
  assert unforked[start - 1][0] == pytest.approx(0.05) and unforked[-1][0] < 0.01   # it did cool down


@pytest.mark.parametrize("bad", [dict(peak_learning_rate=0.0), dict(b2=1.0),
                                 dict(final_learning_rate_fraction=1.5),
                                 dict(weight_decay=-1.0), dict(schedule="step"),
                                 dict(cooldown_fraction=1.5),
                                 dict(cooldown_shape="cosine")])
def test_config_rejects_bad_values(bad):
  with pytest.raises(ValueError, match="OptimizerConfig"):
    opt_lib.OptimizerConfig(**bad)


def _tiny_config(**overrides):
  base = dict(vocab_size=64, width=32, rnn_width=32, num_heads=2, depth=4,
              attention_window=8)
  base.update(overrides)
  return ModelConfig(**base)


def test_weight_decay_mask_on_real_model_tree():
  config = _tiny_config(lru_variant="complex")
  params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  mask = opt_lib.weight_decay_mask(params)
  flat = {partition.path_str(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(mask)[0]}
  decayed = {p for p, v in flat.items() if v}
  excluded = {p for p, v in flat.items() if not v}
  for path in excluded:
    leaf = path.rsplit("/", 1)[-1]
    assert (leaf in ("bias", "scale", "a_param", "theta") or "embedding" in path), path
  for path in decayed:
    assert path.endswith("kernel"), path
  # Every kind of parameter the brief names is on the right side.
  assert any(p.endswith("rg_lru/a_param") for p in excluded)
  assert any(p.endswith("rg_lru/theta") for p in excluded)
  assert any(p.endswith("final_norm/scale") for p in excluded)
  assert any(p.endswith("temporal_norm/scale") for p in excluded)
  assert "embedder/embedding" in excluded
  assert any(p.endswith("linear_x/bias") for p in excluded)
  assert any(p.endswith("rg_lru/a_gate/kernel") for p in decayed)
  assert any(p.endswith("attention/q/kernel") for p in decayed)
  assert any(p.endswith("mlp/down/kernel") for p in decayed)
  assert any(p.endswith("conv1d/kernel") for p in decayed)


def test_weight_decay_touches_only_masked_params():
  params = {"dense": {"kernel": jnp.ones((3, 3)), "bias": jnp.ones(3)},
            "norm": {"scale": jnp.ones(3)}}
  config = opt_lib.OptimizerConfig(peak_learning_rate=0.1, warmup_steps=0,
                                   weight_decay=0.5, clip_norm=None)
  tx = opt_lib.make_optimizer(config, total_steps=10)
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero_grads, tx.init(params), params)
  np.testing.assert_allclose(updates["dense"]["kernel"], -0.1 * 0.5 * np.ones((3, 3)),
                             rtol=1e-6)
  np.testing.assert_array_equal(updates["dense"]["bias"], 0.0)
  np.testing.assert_array_equal(updates["norm"]["scale"], 0.0)


def test_clipping_scales_gradients_by_global_norm():
  # With eps = 1 Adam's first update depends on the gradient's scale: g / (|g| + 1).
  grads = {"a": jnp.full((4,), 10.0)}                       # global norm 20: clipped to 0.5 each
  for clip, expected in ((1.0, 0.5 / 1.5), (None, 10.0 / 11.0)):
    config = opt_lib.OptimizerConfig(peak_learning_rate=1.0, warmup_steps=0, eps=1.0,
                                     weight_decay=0.0, clip_norm=clip)
    tx = opt_lib.make_optimizer(config, total_steps=10)
    updates, _ = tx.update(grads, tx.init(grads), grads)
    np.testing.assert_allclose(np.asarray(updates["a"]), -expected, rtol=1e-5)


def _batch(rng, rows, length, vocab):
  tokens = rng.integers(3, vocab, size=(rows, length + 1)).astype(np.int32)
  positions = np.tile(np.arange(length, dtype=np.int32), (rows, 1))
  positions[1, length // 2:] = np.arange(length - length // 2)   # a document start
  weights = rng.random((rows, length)) > 0.2                       # some masked tokens
  return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
          "positions": jnp.asarray(positions), "weights": jnp.asarray(weights, jnp.float32),
          "segment_ids": jnp.ones((rows, length), jnp.int32)}


@pytest.mark.slow
def test_microbatch_accumulation_equals_big_batch():
  config = _tiny_config(width=16, rnn_width=16, depth=3)
  model = LanguageModel(config)
  params = init_params(config, jax.random.key(1))
  # Plain SGD: the parameter change is minus rate x gradient (Adam's first step would
  # reduce it to signs and hide small differences). A large rate keeps the float32
  # rounding of `params - update` far below the gradient differences we test.
  rate = 1e3
  schedule = optax.constant_schedule(rate)
  tx = optax.sgd(rate)
  batch = _batch(np.random.default_rng(0), rows=8, length=12, vocab=64)
  state = steps.TrainState(jnp.int32(0), params, tx.init(params))
  results = {}
  for count in (1, 4):
    step = jax.jit(steps.make_train_step(model, tx, schedule, microbatches=count,
                                           z_loss_weight=1e-3))
    results[count] = step(state, batch)
  (big_state, big), (acc_state, acc) = results[1], results[4]
  # The loss is the masked mean over the whole batch, not a mean of microbatch means.
  @jax.jit
  def mean_loss(params, batch):
    logits, _ = model.apply({"params": params}, batch["inputs"], batch["positions"])
    nll, _ = losses.token_losses(logits, batch["targets"])
    return jnp.sum(nll * batch["weights"]) / jnp.sum(batch["weights"])
  reference = float(mean_loss(params, batch))
  np.testing.assert_allclose(float(big["loss"]), reference, rtol=1e-6)
  np.testing.assert_allclose(float(acc["loss"]), reference, rtol=1e-6)
  np.testing.assert_allclose(float(acc["grad_norm"]), float(big["grad_norm"]), rtol=1e-5)
  for before, a, b in zip(jax.tree.leaves(params), jax.tree.leaves(acc_state.params),
                          jax.tree.leaves(big_state.params)):
    grad_acc, grad_big = np.asarray(before - a) / rate, np.asarray(before - b) / rate
    scale = np.abs(grad_big).max()
    np.testing.assert_allclose(grad_acc, grad_big, rtol=1e-4, atol=1e-5 * scale)
