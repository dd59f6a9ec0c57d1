"""Prefill then token-by-token decoding reproduces the full forward pass.

Row 0 holds one document and starts a new one during decoding; row 1 packs two documents
inside the prompt. The prompt (6 tokens) is longer than the local window (4) and decoding
runs well past it, so the ring buffer wraps.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import decoding, lm
from model.config import ModelConfig

TINY = dict(vocab_size=64, width=32, rnn_width=48, num_heads=2, attention_window=4)
PRESETS = {
    "griffin": ModelConfig(**TINY, depth=4),  # one scanned (R, R, A) unit + a trailing R
    "hawk": ModelConfig(**TINY, depth=2, block_pattern=("recurrent",)),
    "mqa": ModelConfig(**{**TINY, "attention_window": None}, depth=2,
                       block_pattern=("attention",)),
    "griffin_cg_lru": ModelConfig(**TINY, depth=3, lru_variant="complex"),
    "gateloop": ModelConfig(**TINY, depth=2, block_pattern=("gateloop", "attention")),
}
LENGTH, PROMPT = 14, 6
POSITIONS = jnp.asarray([list(range(10)) + list(range(4)),
                         list(range(3)) + list(range(11))], jnp.int32)


def max_length(config):
  return LENGTH if config.attention_window is None else None


@functools.lru_cache(maxsize=None)
def compiled(config):
  """(forward, prefill, step) jitted for one config."""
  model = lm.LanguageModel(config)
  forward = jax.jit(lambda p, t, q: model.apply({"params": p}, t, q)[0])
  prefill = jax.jit(functools.partial(decoding.prefill, config))
  step = jax.jit(functools.partial(decoding.decode_step, config))
  return forward, prefill, step


def decode(config, params, tokens, chunks):
  """Logits of `tokens` fed in the given chunks (the first is the prefill)."""
  _, prefill, step = compiled(config)
  cache = None
  if config.attention_window is None:
    cache = decoding.init_cache(config, tokens.shape[0], jnp.float32, max_length(config))
  outputs, start = [], 0
  for size in chunks:
    stop = start + size
    if cache is None:
      logits, cache = prefill(params, tokens[:, start:stop], POSITIONS[:, start:stop])
    else:
      logits, cache = step(params, tokens[:, start:stop], POSITIONS[:, start:stop], cache)
    outputs.append(logits)
    start = stop
  return jnp.concatenate(outputs, axis=1), cache


def setup(name):
  config = PRESETS[name]
  params = lm.init_params(config, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, LENGTH), 0, config.vocab_size)
  forward, _, _ = compiled(config)
  return config, params, tokens, forward(params, tokens, POSITIONS)


def assert_logits_equal(actual, expected):
  expected = np.asarray(expected)
  np.testing.assert_allclose(actual, expected, rtol=1e-5,
                             atol=1e-5 * np.abs(expected).max())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_step_by_step_decoding_equals_forward(name):
  config, params, tokens, full = setup(name)
  decoded, cache = decode(config, params, tokens, [PROMPT] + [1] * (LENGTH - PROMPT))
  assert_logits_equal(decoded, full)
  # The cache has the structure and shapes init_cache promises (no retrace per step).
  empty = decoding.init_cache(config, 2, jnp.float32, max_length(config))
  assert jax.tree.structure(cache) == jax.tree.structure(empty)
  for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(empty)):
    assert got.shape == want.shape and got.dtype == want.dtype


@pytest.mark.slow
def test_multi_token_calls_with_a_cache_equal_forward():
  config, params, tokens, full = setup("griffin")
  decoded, _ = decode(config, params, tokens, [PROMPT, 3] + [1] * (LENGTH - PROMPT - 3))
  assert_logits_equal(decoded, full)


def test_decoding_depends_on_the_cache():
  """Feeding the same step with an empty cache gives different logits (non-vacuous)."""
  config, params, tokens, full = setup("hawk")
  _, _, step = compiled(config)
  empty = decoding.init_cache(config, 2, jnp.float32)
  logits, _ = step(params, tokens[:, 7:8], POSITIONS[:, 7:8], empty)
  assert not np.allclose(logits, full[:, 7:8], atol=1e-3)


def test_global_attention_needs_a_max_length():
  with pytest.raises(ValueError, match="max_length"):
    decoding.init_cache(PRESETS["mqa"], 1, jnp.float32)
  config = PRESETS["mqa"]
  params = jax.eval_shape(lambda: lm.init_params(config, jax.random.PRNGKey(0)))
  with pytest.raises(ValueError, match="max_length"):
    jax.eval_shape(functools.partial(decoding.prefill, config), params,
                   jnp.zeros((1, 3), jnp.int32), jnp.arange(3, dtype=jnp.int32)[None])


def test_recurrent_state_has_constant_size():
  config = PRESETS["griffin"]
  short = decoding.init_cache(config, 2, jnp.bfloat16)
  longer = decoding.init_cache(config, 2, jnp.bfloat16, max_length=10_000)
  assert jax.tree.map(jnp.shape, short) == jax.tree.map(jnp.shape, longer)
  rg_lru = short["blocks"][0].rg_lru
  assert rg_lru.shape == (1, 2, 48) and rg_lru.dtype == jnp.float32
  assert short["blocks"][0].conv1d.dtype == jnp.bfloat16
