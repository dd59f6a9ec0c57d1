"""The chunked cross-entropy (pretrain.losses) against the plain one: values, gradients,
and the memory it exists for (no float32 [B, T, V] buffer in the compiled program)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import ModelConfig
from model.lm import LanguageModel, init_params, output_logits
from pretrain.losses import chunked_token_losses, loss_sums, token_losses


def _inputs(seed, batch, length, width, vocab):
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(batch, length, width)).astype(np.float32)
  embedding = (rng.normal(size=(vocab, width)) / np.sqrt(width)).astype(np.float32)
  targets = rng.integers(0, vocab, size=(batch, length)).astype(np.int32)
  weights = rng.uniform(size=(batch, length)).astype(np.float32)
  return hidden, embedding, targets, weights


def _objective(losses_fn, weights):
  """A real scalar touching nll and log Z at every token, so every gradient is checked."""
  def objective(hidden, embedding, targets):
    nll, log_z = losses_fn(hidden, embedding, targets)
    return jnp.sum(nll * weights) + 0.1 * jnp.sum(jnp.square(log_z) * weights)
  return objective


@pytest.mark.parametrize("batch,length,width,vocab,chunks,cap", [
    (2, 16, 8, 50, 4, None), (1, 24, 16, 300, 3, 30.0), (3, 8, 4, 7, 8, None),
    (2, 32, 8, 64, 1, None)])
def test_chunked_equals_plain_values_and_gradients(batch, length, width, vocab, chunks, cap):
  hidden, embedding, targets, weights = _inputs(length, batch, length, width, vocab)
  config = ModelConfig(vocab_size=vocab, width=width, num_heads=1, logits_soft_cap=cap)
  plain = lambda h, e, t: token_losses(output_logits(config, e, h), t)
  chunked = lambda h, e, t: chunked_token_losses(config, e, h, t, chunks)
  for got, want in zip(jax.jit(chunked)(hidden, embedding, targets),
                       jax.jit(plain)(hidden, embedding, targets)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  grad = lambda fn: jax.jit(jax.value_and_grad(_objective(fn, weights), argnums=(0, 1)))
  (value, grads), (want_value, want_grads) = (grad(chunked)(hidden, embedding, targets),
                                              grad(plain)(hidden, embedding, targets))
  assert abs(value - want_value) <= 1e-6 * abs(want_value)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_gradient_matches_finite_differences():
  hidden, embedding, targets, weights = _inputs(0, 1, 8, 4, 11)
  config = ModelConfig(vocab_size=11, width=4, num_heads=1)
  objective = jax.jit(_objective(
      lambda h, e, t: chunked_token_losses(config, e, h, t, 4), weights))
  grad = jax.grad(objective, argnums=1)(hidden, embedding, targets)
  rng = np.random.default_rng(1)
  direction = rng.normal(size=embedding.shape).astype(np.float32)
  eps = 1e-2
  numeric = (objective(hidden, embedding + eps * direction, targets)
             - objective(hidden, embedding - eps * direction, targets)) / (2 * eps)
  np.testing.assert_allclose(np.sum(np.asarray(grad) * direction), numeric, rtol=2e-3)


@pytest.mark.slow
def test_model_loss_sums_match_and_no_full_logits_buffer():
  config = ModelConfig(vocab_size=512, width=32, rnn_width=32, depth=2, num_heads=2,
                       block_pattern=("recurrent", "attention"), attention_window=8)
  model = LanguageModel(config)
  params = init_params(config, jax.random.key(0))
  rng = np.random.default_rng(0)
  batch = {"inputs": rng.integers(0, 512, (2, 32)).astype(np.int32),
           "targets": rng.integers(0, 512, (2, 32)).astype(np.int32),
           "positions": np.tile(np.arange(32, dtype=np.int32), (2, 1)),
           "weights": np.ones((2, 32), np.float32)}
  compiled = {chunks: jax.jit(jax.grad(
      lambda p, chunks=chunks: loss_sums(model, p, batch, 1e-3, chunks), has_aux=True)
  ).lower(params).compile() for chunks in (1, 8)}
  grads, sums = compiled[8](params)
  want_grads, want_sums = compiled[1](params)
  for name in sums:
    np.testing.assert_allclose(sums[name], want_sums[name], rtol=1e-6)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
  full = re.compile(r"f32\[2,32,512\]")
  assert full.search(compiled[1].as_text())  # the check can fail
  chunked_hlo = compiled[8].as_text()
  assert not full.search(chunked_hlo) and re.search(r"f32\[2,4,512\]", chunked_hlo)
