"""GateLoop block against a step-by-step numpy reference with complex states."""
from typing import Optional

import flax.linen as nn
import gin
import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import ModelConfig
from model.blocks.gateloop.layer import GateLoopBlock
from pretrain import gin_config


def reference_gateloop(x: np.ndarray, segment_pos: np.ndarray, params: dict, head_dim: int,
                       fixed_transitions: bool = False,
                       state: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
  """The paper's recurrence one token and one head at a time, in float64/complex128."""
  x = np.asarray(x, np.float64)
  batch, length, width = x.shape
  heads = width // head_dim

  def dense(name, inputs, bias=False):
    out = inputs @ np.asarray(params[name]["kernel"], np.float64)
    return out + np.asarray(params[name]["bias"], np.float64) if bias else out

  q, k, v = dense("query", x), dense("key", x), dense("value", x)
  if fixed_transitions:
    gamma = np.broadcast_to(np.asarray(params["fixed_magnitude"], np.float64), x.shape)
    theta = np.broadcast_to(np.asarray(params["fixed_phase"], np.float64), x.shape)
  else:
    gamma, theta = dense("magnitude", x, bias=True), dense("phase", x, bias=True)
  a = 1.0 / (1.0 + np.exp(-gamma)) * np.exp(1j * theta)

  h = (np.zeros((batch, heads, head_dim, head_dim), np.complex128) if state is None
       else np.asarray(state, np.complex128).reshape(batch, heads, head_dim, head_dim))
  y = np.zeros((batch, length, width))
  for b in range(batch):
    for t in range(length):
      for n in range(heads):
        cols = slice(n * head_dim, (n + 1) * head_dim)
        transition = np.zeros(head_dim) if segment_pos[b, t] == 0 else a[b, t, cols]
        h[b, n] = transition[:, None] * h[b, n] + np.outer(k[b, t, cols], v[b, t, cols])
        y[b, t, cols] = np.real(q[b, t, cols] @ h[b, n])
  return dense("output", y), h.reshape(batch, -1)


def make_config(width=8, head_dim=1, fixed=False, dtype="float32"):
  return ModelConfig(width=width, rnn_width=width, num_heads=2, depth=2,
                     block_pattern=("gateloop",), gateloop_head_dim=head_dim,
                     gateloop_fixed_transitions=fixed, dtype=dtype)


def packed_positions(batch, length, starts):
  """Positions restarting at each index in `starts` (and at 0)."""
  pos = np.zeros((batch, length), np.int32)
  for b in range(batch):
    counter = 0
    for t in range(length):
      counter = 0 if (t == 0 or t in starts[b]) else counter + 1
      pos[b, t] = counter
  return pos


def init_block(config, batch=2, length=11, seed=0):
  block = GateLoopBlock(config)
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(batch, length, config.width)).astype(np.float32)
  pos = packed_positions(batch, length, [[5], [3, 8]][:batch] + [[]] * max(0, batch - 2))
  variables = block.init(jax.random.PRNGKey(seed), jnp.asarray(x), jnp.asarray(pos))
  params = nn.unbox(variables["params"])
  # Widen the transition biases so that some channels forget fast and others keep
  # memories, and the test exercises both regimes.
  if "magnitude" in params:
    params["magnitude"]["bias"] = jnp.asarray(rng.normal(0, 2, config.width), jnp.float32)
  return block, params, x, pos


CASES = [
    dict(width=8, head_dim=1, fixed=False),
    dict(width=8, head_dim=4, fixed=False),
    dict(width=6, head_dim=2, fixed=True),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"w{c['width']}_dh{c['head_dim']}_fixed{c['fixed']}")
def test_matches_reference_with_resets(case):
  config = make_config(**case)
  block, params, x, pos = init_block(config)
  y, last = jax.jit(lambda p, x, s: block.apply({"params": p}, x, s, return_cache=True))(
      params, x, pos)
  y_ref, last_ref = reference_gateloop(x, pos, params, case["head_dim"], case["fixed"])
  assert y.shape == x.shape and last.dtype == jnp.complex64
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(last), last_ref, rtol=1e-4, atol=1e-4)


def test_bfloat16_compute_close_to_reference():
  config = make_config(width=8, head_dim=2, dtype="bfloat16")
  block, params, x, pos = init_block(config)
  y, _ = block.apply({"params": params}, x, pos)
  assert y.dtype == jnp.bfloat16
  y_ref, _ = reference_gateloop(x, pos, params, 2)
  scale = np.abs(y_ref).max()
  np.testing.assert_allclose(np.asarray(y, np.float32), y_ref, atol=0.03 * scale)


def test_document_reset_isolates_documents():
  config = make_config(width=8, head_dim=2)
  block, params, x, pos = init_block(config, batch=1, length=11)
  pos = packed_positions(1, 11, [[6]])
  packed, _ = block.apply({"params": params}, x, pos)
  alone, _ = block.apply({"params": params}, x[:, 6:], pos[:, 6:])
  np.testing.assert_allclose(np.asarray(packed[:, 6:]), np.asarray(alone), atol=1e-5)
  # Without the reset, the second document sees the first one's state.
  unreset, _ = block.apply({"params": params}, x, np.arange(11)[None])
  assert np.abs(np.asarray(unreset[:, 6:]) - np.asarray(alone)).max() > 1e-3


@pytest.mark.parametrize("fixed", [False, True])
def test_one_token_decoding_matches_full_pass(fixed):
  config = make_config(width=8, head_dim=2, fixed=fixed)
  block, params, x, pos = init_block(config, batch=2, length=9)
  full, _ = block.apply({"params": params}, x, pos)
  apply = jax.jit(lambda c, xt, st: block.apply({"params": params}, xt, st, cache=c,
                                                return_cache=True))
  # Prefill the first 4 tokens, then decode one token at a time from the cache.
  _, cache = apply(GateLoopBlock.init_cache(config, 2, jnp.float32), x[:, :4], pos[:, :4])
  steps = []
  for t in range(4, 9):
    y_t, cache = apply(cache, x[:, t:t + 1], pos[:, t:t + 1])
    steps.append(y_t)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full[:, 4:]),
                             rtol=1e-5, atol=1e-5)
  assert cache.shape == (2, GateLoopBlock.state_size(config))


@pytest.mark.parametrize("case", CASES[:2] + [dict(width=6, head_dim=1, fixed=True)],
                         ids=["dh1", "dh4", "fixed"])
def test_gradients_match_reference_finite_differences(case):
  """d loss / d (params, x) from JAX against central differences of the float64 reference."""
  config = make_config(**case)
  block, params, x, pos = init_block(config, length=7)
  rng = np.random.default_rng(1)
  cotangent = rng.normal(size=x.shape)

  def loss(p, inputs):
    y, _ = block.apply({"params": p}, inputs, pos)
    return jnp.sum(y * cotangent)

  grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

  def ref_loss(p, inputs):
    y, _ = reference_gateloop(inputs, pos, p, case["head_dim"], case["fixed"])
    return float(np.sum(y * cotangent))

  # Perturb in float64 (ravel_pytree's unravel would round back to float32).
  leaves, treedef = jax.tree.flatten(params)
  flat = np.concatenate([np.asarray(leaf, np.float64).ravel() for leaf in leaves])
  grad_flat = np.asarray(ravel_pytree(grads[0])[0], np.float64)
  splits = np.cumsum([leaf.size for leaf in leaves])[:-1]
  to_np = lambda v: jax.tree.unflatten(
      treedef, [c.reshape(l.shape) for c, l in zip(np.split(v, splits), leaves)])
  eps = 1e-5
  for trial in range(3):
    direction = rng.normal(size=flat.shape)
    numeric = (ref_loss(to_np(flat + eps * direction), x)
               - ref_loss(to_np(flat - eps * direction), x)) / (2 * eps)
    np.testing.assert_allclose(grad_flat @ direction, numeric, rtol=2e-3, atol=1e-3)
    dx = rng.normal(size=x.shape)
    x64 = np.asarray(x, np.float64)
    numeric_x = (ref_loss(params, x64 + eps * dx) - ref_loss(params, x64 - eps * dx)) / (2 * eps)
    np.testing.assert_allclose(np.sum(np.asarray(grads[1], np.float64) * dx), numeric_x,
                               rtol=2e-3, atol=1e-3)


def test_gradient_reaches_the_transition_phase():
  """The phase only matters through the complex state; its gradient must not vanish."""
  config = make_config(width=8, head_dim=1)
  block, params, x, pos = init_block(config)
  grads = jax.grad(lambda p: jnp.sum(block.apply({"params": p}, x, pos)[0] ** 2))(params)
  assert np.abs(np.asarray(grads["phase"]["kernel"])).max() > 1e-4
  assert np.abs(np.asarray(grads["magnitude"]["kernel"])).max() > 1e-4


def test_fixed_transitions_do_not_depend_on_the_input():
  config = make_config(width=8, head_dim=1, fixed=True)
  _, params, _, _ = init_block(config)
  assert set(params) == {"query", "key", "value", "output", "fixed_magnitude", "fixed_phase"}
  assert params["fixed_magnitude"].shape == (8,)


def test_parameters_carry_logical_axis_names():
  config = make_config(width=8, head_dim=2)
  block = GateLoopBlock(config)
  variables = block.init(jax.random.PRNGKey(0), jnp.zeros((1, 3, 8)), jnp.zeros((1, 3), jnp.int32))
  specs = nn.get_partition_spec(variables)["params"]
  assert tuple(specs["query"]["kernel"]) == ("embed", "rnn")
  assert tuple(specs["magnitude"]["bias"]) == ("rnn",)
  assert tuple(specs["output"]["kernel"]) == ("rnn", "embed")


@pytest.mark.slow
def test_initial_transition_magnitudes_in_documented_range():
  config = make_config(width=64, head_dim=1, fixed=True)
  _, params, _, _ = init_block(config)
  magnitude = jax.nn.sigmoid(params["fixed_magnitude"])
  assert 0.9 <= float(magnitude.min()) and float(magnitude.max()) <= 0.999


def test_wrong_width_names_the_field():
  block = GateLoopBlock(make_config(width=8))
  with pytest.raises(ValueError, match="ModelConfig.width"):
    block.init(jax.random.PRNGKey(0), jnp.zeros((1, 3, 6)), jnp.zeros((1, 3), jnp.int32))


@pytest.mark.parametrize("preset", ["gateloop_tiny", "gateloop_100m"])
def test_presets_build_a_valid_gateloop_config(preset):
  try:
    gin_config.parse([f"configs/models/{preset}.gin"], [])
    config = gin_config.build_model_config()
  finally:
    gin.clear_config()
  assert set(config.block_types) == {"gateloop"}
  assert config.width % config.gateloop_head_dim == 0
