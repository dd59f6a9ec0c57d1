"""Every model layer against a plain step-by-step numpy reference (float64).

Inputs are random, rows hold several documents (positions restarting at 0) and one row
starts in the middle of a document; each layer runs in float32 (tight tolerance) and
bfloat16 (loose). Gradients of the recurrences are checked against float64 central
differences of the numpy references along random directions.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.blocks.attention.layer import AttentionBlock
from model.config import ModelConfig
from model.blocks.recurrent.conv1d import Conv1D
from model.embedder import Embedder, embedding_scale
from model.mlp import GatedMLP
from model.norms import RMSNorm
from model.blocks.recurrent.rg_lru import BlockDiagonalLinear, RGLRU, sqrt_bounded_gradient
from model.rope import apply_rope

TOL = {"float32": 2e-5, "bfloat16": 3e-2}


# -- helpers ------------------------------------------------------------------------------
def segment_positions(batch: int, length: int, seed: int) -> np.ndarray:
  """Rows of packed documents; row 0 starts mid-document (no reset at t=0)."""
  rng = np.random.default_rng(seed)
  rows = []
  for b in range(batch):
    pos, p = [], (5 if b == 0 else 0)
    for _ in range(length):
      pos.append(p)
      p = 0 if rng.random() < 0.2 else p + 1
    rows.append(pos)
  return np.asarray(rows, np.int32)


def doc_start(seg: np.ndarray, b: int, t: int) -> int:
  """Index of the start of token t's document in row b (0 if it began before the row)."""
  while t > 0 and seg[b, t] != 0:
    t -= 1
  return t


def init(layer, *args, seed=0, method=None):
  """Unboxed float32 params of `layer` (jit-compiled: one compile, not one per op)."""
  fn = jax.jit(lambda key, *a: layer.init(key, *a, method=method))
  return nn.meta.unbox(fn(jax.random.PRNGKey(seed), *args))["params"]


def run(layer, params, *args, method=None):
  """layer.apply under jit; trailing Python bools (return_cache) stay static."""
  arrays = [a for a in args if not isinstance(a, bool)]
  flags = [a for a in args if isinstance(a, bool)]
  fn = jax.jit(lambda p, *a: layer.apply({"params": p}, *a, *flags, method=method))
  return fn(params, *arrays)


def as_np(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def sigmoid(x):
  return 1 / (1 + np.exp(-x))


def softplus(x):
  return np.log1p(np.exp(x))


def assert_close(actual, expected, dtype):
  actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  scale = max(np.abs(expected).max(), 1e-3)
  np.testing.assert_allclose(actual, expected, atol=TOL[dtype] * scale, rtol=TOL[dtype])


def directional_check(jax_fn, numpy_fn, args, seed=0, eps=1e-5, rtol=2e-3):
  """grad(jax_fn) · v equals the float64 central difference of numpy_fn along v."""
  rng = np.random.default_rng(seed)
  directions = jax.tree.map(lambda a: rng.normal(size=a.shape), args)
  grads = jax.jit(jax.grad(jax_fn))(args)
  analytic = sum(float(np.sum(np.asarray(g, np.float64) * d))
                 for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(directions)))
  base = as_np(args)
  plus = jax.tree.map(lambda a, d: a + eps * d, base, directions)
  minus = jax.tree.map(lambda a, d: a - eps * d, base, directions)
  numeric = (numpy_fn(plus) - numpy_fn(minus)) / (2 * eps)
  np.testing.assert_allclose(analytic, numeric, rtol=rtol, atol=1e-6)


# -- RMSNorm, MLP, embedder, block-diagonal gates -------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rmsnorm_matches_numpy(dtype):
  x = np.random.default_rng(0).normal(size=(2, 5, 12)) * 3
  norm = RMSNorm(dtype)
  params = init(norm, jnp.asarray(x, jnp.float32))
  assert np.all(np.asarray(params["scale"]) == 0)
  scale = np.random.default_rng(1).normal(size=12)
  y = run(norm, {"scale": jnp.asarray(scale, jnp.float32)}, jnp.asarray(x, dtype))
  assert y.dtype == jnp.dtype(dtype)
  expected = x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + 1e-6) * (1 + scale)
  assert_close(y, expected, dtype)


def gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_mlp_matches_numpy(dtype):
  cfg = ModelConfig(width=16, num_heads=2, mlp_expansion=3, depth=4, dtype=dtype)
  x = np.random.default_rng(0).normal(size=(2, 3, 16))
  mlp = GatedMLP(cfg)
  params = init(mlp, jnp.zeros((1, 1, 16)))
  params = jax.tree.map(lambda p: p + 0.1, params)  # non-zero biases
  y = run(mlp, params, jnp.asarray(x, dtype))
  p = as_np(params)
  dense = lambda n, h: h @ p[n]["kernel"] + p[n]["bias"]
  expected = dense("down", gelu_tanh(dense("gate", x)) * dense("up", x))
  assert_close(y, expected, dtype)


@pytest.mark.slow
def test_initialisation_statistics():
  """LeCun-normal inputs, 2/depth final layers, 1/√D embedding (docs/model.md#initialisation)."""
  cfg = ModelConfig(vocab_size=512, width=256, rnn_width=256, num_heads=4, depth=8)
  mlp = init(GatedMLP(cfg), jnp.zeros((1, 1, 256)))
  assert np.std(mlp["gate"]["kernel"]) == pytest.approx((1 / 512) ** 0.5, rel=0.05)
  assert np.std(mlp["down"]["kernel"]) == pytest.approx((2 / 8 / 768) ** 0.5, rel=0.05)
  emb = init(Embedder(cfg), jnp.zeros((1, 1), jnp.int32), method=Embedder.encode)
  emb = emb["embedding"]
  assert np.std(emb) == pytest.approx(256 ** -0.5, rel=0.05)
  conv = init(Conv1D(cfg), jnp.zeros((1, 1, 256)), jnp.zeros((1, 1), jnp.int32))["kernel"]
  assert np.std(conv) == pytest.approx((0.01 / 4) ** 0.5, rel=0.05)
  lru = init(RGLRU(cfg), jnp.zeros((1, 1, 256)), jnp.zeros((1, 1), jnp.int32))
  base_decay = np.exp(-softplus(np.asarray(lru["a_param"], np.float64)))
  assert base_decay.min() >= 0.9 - 1e-6 and base_decay.max() <= 0.999 + 1e-6
  # The square of the base decay is uniform on [0.81, 0.998]: its mean sits mid-range.
  assert np.mean(base_decay ** 2) == pytest.approx((0.81 + 0.999 ** 2) / 2, abs=0.02)
  assert np.std(lru["a_gate"]["kernel"]) == pytest.approx(256 ** -0.5, rel=0.05)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embedder_encode_decode(dtype):
  cfg = ModelConfig(vocab_size=11, width=8, num_heads=2, embeddings_scale_by_sqrt_dim=True,
                    dtype=dtype)
  table = np.random.default_rng(0).normal(size=(11, 8))
  params = {"embedding": jnp.asarray(table, jnp.float32)}
  tokens = np.array([[3, 0, 10]])
  x = run(Embedder(cfg), params, jnp.asarray(tokens), method=Embedder.encode)
  assert embedding_scale(8) == float(jnp.bfloat16(np.sqrt(8.0)))
  assert_close(x, table[tokens] * embedding_scale(8), dtype)
  logits = run(Embedder(cfg), params, x, method=Embedder.decode)
  assert logits.dtype == jnp.float32
  assert_close(logits, np.asarray(x, np.float64) @ table.T, dtype)


def test_block_diagonal_linear_is_a_block_diagonal_matrix():
  x = np.random.default_rng(0).normal(size=(2, 3, 12))
  layer = BlockDiagonalLinear(num_blocks=3, features=6)
  params = init(layer, jnp.zeros((1, 1, 12)))
  p = as_np(params)
  dense = np.zeros((12, 6))
  for h in range(3):
    dense[4 * h:4 * h + 4, 2 * h:2 * h + 2] = p["kernel"][h]
  expected = x @ dense + p["bias"].reshape(-1)
  assert_close(run(layer, params, jnp.asarray(x, jnp.float32)), expected,
               "float32")


# -- RoPE ---------------------------------------------------------------------------------
def rope_reference(x, positions):
  """Rotate channel pairs (i, i + H/4), i < H/4, by positions / 10000^(4i/H)."""
  out = np.array(x, np.float64)
  head_dim = x.shape[-1]
  quarter = head_dim // 4
  for i in range(quarter):
    angle = positions[:, :, None] / 10000 ** (2 * i / (head_dim // 2))
    u, v = x[..., i], x[..., i + quarter]
    out[..., i] = u * np.cos(angle) - v * np.sin(angle)
    out[..., i + quarter] = v * np.cos(angle) + u * np.sin(angle)
  return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [4, 16])
def test_rope_matches_pairwise_rotation(dtype, head_dim):
  x = np.random.default_rng(0).normal(size=(2, 7, 3, head_dim))
  positions = segment_positions(2, 7, seed=1)
  y = apply_rope(jnp.asarray(x, dtype), jnp.asarray(positions))
  assert y.dtype == jnp.dtype(dtype)
  assert_close(y, rope_reference(x, positions), dtype)
  # The second half of each head is never rotated.
  np.testing.assert_array_equal(np.asarray(y[..., head_dim // 2:], np.float32),
                                np.asarray(jnp.asarray(x, dtype)[..., head_dim // 2:],
                                           np.float32))


def test_rope_rejects_head_dim_not_divisible_by_4():
  with pytest.raises(ValueError, match="divisible by 4"):
    apply_rope(jnp.zeros((1, 2, 1, 6)), jnp.zeros((1, 2), jnp.int32))


# -- Conv1D -------------------------------------------------------------------------------
def conv_reference(x, seg, kernel, bias):
  batch, length, _ = x.shape
  width = kernel.shape[0]
  out = np.tile(bias, (batch, length, 1)).astype(np.float64)
  for b in range(batch):
    for t in range(length):
      start = doc_start(seg, b, t)
      for k in range(width):
        if t - k >= start:
          out[b, t] += kernel[width - 1 - k] * x[b, t - k]
  return out


@pytest.mark.parametrize("dtype,shape,conv_width", [("float32", (2, 13, 8), 4),
                                                    ("float32", (3, 3, 6), 4),
                                                    ("float32", (1, 9, 4), 2),
                                                    ("bfloat16", (2, 13, 8), 4)])
def test_conv1d_matches_numpy(dtype, shape, conv_width):
  cfg = ModelConfig(width=8, rnn_width=shape[2], num_heads=2, conv_width=conv_width,
                    dtype=dtype)
  x = np.random.default_rng(0).normal(size=shape)
  seg = segment_positions(shape[0], shape[1], seed=2)
  conv = Conv1D(cfg)
  params = init(conv, jnp.zeros((1, 1, shape[2])), jnp.zeros((1, 1), jnp.int32))
  params = jax.tree.map(lambda p: p + jnp.linspace(-1, 1, p.size).reshape(p.shape), params)
  y, _ = run(conv, params, jnp.asarray(x, dtype), jnp.asarray(seg))
  p = as_np(params)
  assert_close(y, conv_reference(x, seg, p["kernel"], p["bias"]), dtype)


def test_conv1d_chunks_with_state_equal_one_call():
  cfg = ModelConfig(width=8, rnn_width=6, num_heads=2)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 12, 6)), jnp.float32)
  seg = jnp.asarray(segment_positions(2, 12, seed=3))
  conv = Conv1D(cfg)
  params = init(conv, x, seg)
  full, _ = run(conv, params, x, seg)
  state, pieces = Conv1D.init_cache(cfg, 2, jnp.float32), []
  for lo, hi in [(0, 2), (2, 7), (7, 8), (8, 12)]:
    y, state = run(conv, params, x[:, lo:hi], seg[:, lo:hi], state, True)
    pieces.append(y)
  np.testing.assert_allclose(jnp.concatenate(pieces, 1), full, atol=1e-6)


# -- RG-LRU and CG-LRU --------------------------------------------------------------------
def lru_reference(x, seg, p, complex_variant, h0=None):
  """The recurrence one step at a time (float64 / complex128)."""
  batch, length, channels = x.shape
  blocks = p["input_gate"]["kernel"].shape[0]

  def gate(name):
    w, bias = p[name]["kernel"], p[name]["bias"]
    xb = x.reshape(batch, length, blocks, -1)
    return sigmoid(np.einsum("bthi,hio->btho", xb, w) + bias).reshape(batch, length, -1)

  gate_x, gate_a = gate("input_gate"), gate("a_gate")
  magnitude = np.exp(-8 * gate_a * softplus(p["a_param"]))
  if complex_variant:
    a = magnitude * np.exp(1j * p["theta"] * gate_a)
    inputs = x[..., :channels // 2] + 1j * x[..., channels // 2:]
  else:
    a, inputs = magnitude, x
  h = np.zeros(a.shape[::2], a.dtype) if h0 is None else np.array(h0, a.dtype)
  out = np.zeros(a.shape, a.dtype)
  for t in range(length):
    for b in range(batch):
      if seg[b, t] == 0:
        h[b] = gate_x[b, t] * inputs[b, t]
      else:
        h[b] = a[b, t] * h[b] + np.sqrt(1 - np.abs(a[b, t]) ** 2) * gate_x[b, t] * inputs[b, t]
    out[:, t] = h
  if complex_variant:
    return np.concatenate([out.real, out.imag], -1), h
  return out, h


def lru_setup(variant, shape, blocks, dtype="float32"):
  cfg = ModelConfig(width=8, rnn_width=shape[2], num_heads=2, num_gate_blocks=blocks,
                    lru_variant=variant, dtype=dtype)
  x = np.random.default_rng(0).normal(size=shape)
  seg = segment_positions(shape[0], shape[1], seed=4)
  lru = RGLRU(cfg)
  params = init(lru, jnp.zeros((1, 1, shape[2])), jnp.zeros((1, 1), jnp.int32), seed=1)
  # Non-zero biases so that every parameter matters.
  params = jax.tree.map(lambda q: q + 0.3 * jax.random.normal(jax.random.PRNGKey(2), q.shape),
                        params)
  return cfg, lru, x, seg, params


@pytest.mark.parametrize("variant", ["real", "complex"])
@pytest.mark.parametrize("dtype,shape,blocks", [("float32", (2, 11, 8), 2),
                                                ("float32", (3, 5, 12), 3),
                                                ("bfloat16", (2, 11, 8), 2)])
@pytest.mark.slow
def test_lru_matches_step_by_step_reference(variant, dtype, shape, blocks):
  _, lru, x, seg, params = lru_setup(variant, shape, blocks, dtype)
  rng = np.random.default_rng(5)
  state = shape[2] // 2 if variant == "complex" else shape[2]
  h0 = rng.normal(size=(shape[0], state))
  if variant == "complex":
    h0 = h0 + 1j * rng.normal(size=h0.shape)
  y, h_last = run(lru, params, jnp.asarray(x, dtype), jnp.asarray(seg),
                        jnp.asarray(h0, jnp.complex64 if variant == "complex" else jnp.float32),
                        True)
  expected, expected_last = lru_reference(x, seg, as_np(params), variant == "complex", h0)
  assert y.dtype == jnp.dtype(dtype) and y.shape == shape
  assert_close(y, expected, dtype)
  np.testing.assert_allclose(np.asarray(h_last), expected_last,
                             atol=TOL[dtype] * np.abs(expected_last).max() * 4)


@pytest.mark.parametrize("variant", ["real", "complex"])
def test_lru_gradient_matches_finite_differences(variant):
  _, lru, x, seg, params = lru_setup(variant, (2, 7, 8), 2)
  readout = np.random.default_rng(6).normal(size=(2, 7, 8))

  def loss_jax(args):
    y, _ = lru.apply({"params": args["params"]}, args["x"], jnp.asarray(seg))
    return jnp.sum(y * readout)

  def loss_np(args):
    y, _ = lru_reference(args["x"], seg, args["params"], variant == "complex")
    return float(np.sum(y * readout))

  directional_check(loss_jax, loss_np, {"params": params, "x": jnp.asarray(x, jnp.float32)})


def test_sqrt_gradient_is_clipped_at_1000():
  grad = jax.grad(lambda v: sqrt_bounded_gradient(v, 1000.0))
  assert float(grad(0.0)) == pytest.approx(1000.0)
  assert float(grad(1e-12)) == pytest.approx(1000.0)
  assert float(grad(0.25)) == pytest.approx(1.0)
  assert float(sqrt_bounded_gradient(0.25, 1000.0)) == pytest.approx(0.5)


# -- attention ----------------------------------------------------------------------------
def attention_reference(x, seg, p, heads, window):
  batch, length, width = x.shape
  head_dim = width // heads
  q = rope_reference((x @ p["q"]["kernel"]).reshape(batch, length, heads, head_dim), seg)
  k = rope_reference((x @ p["k"]["kernel"])[:, :, None], seg)[:, :, 0]
  v = x @ p["v"]["kernel"]
  encoded = np.zeros((batch, length, heads, head_dim))
  for b in range(batch):
    for t in range(length):
      lo = doc_start(seg, b, t)
      if window is not None:
        lo = max(lo, t - window)
      scores = np.einsum("nh,sh->ns", q[b, t], k[b, lo:t + 1]) / np.sqrt(head_dim)
      probs = np.exp(scores - scores.max(-1, keepdims=True))
      probs /= probs.sum(-1, keepdims=True)
      encoded[b, t] = probs @ v[b, lo:t + 1]
  return encoded.reshape(batch, length, width) @ p["out"]["kernel"] + p["out"]["bias"]


@pytest.mark.parametrize("dtype,window,heads,shape", [("float32", 3, 2, (2, 12, 16)),
                                                      ("float32", None, 4, (2, 9, 16)),
                                                      ("float32", 1, 1, (1, 6, 8)),
                                                      ("bfloat16", 3, 2, (2, 12, 16))])
def test_attention_matches_numpy(dtype, window, heads, shape):
  cfg = ModelConfig(width=shape[2], num_heads=heads, attention_window=window,
                    block_pattern=("attention",), dtype=dtype)
  x = np.random.default_rng(0).normal(size=shape)
  seg = segment_positions(shape[0], shape[1], seed=7)
  block = AttentionBlock(cfg)
  params = init(block, jnp.zeros((1, 1, shape[2])), jnp.zeros((1, 1), jnp.int32))
  params = jax.tree.map(lambda q: q + 0.1, params)
  y, _ = run(block, params, jnp.asarray(x, dtype), jnp.asarray(seg))
  assert_close(y, attention_reference(x, seg, as_np(params), heads, window), dtype)


def test_logical_axes_cover_every_dimension():
  """Every parameter of every layer carries one logical name (or None) per dimension."""
  cfg = ModelConfig(width=16, rnn_width=16, num_heads=2, lru_variant="complex")
  x, seg = jnp.zeros((1, 2, 16)), jnp.zeros((1, 2), jnp.int32)
  for layer in [RGLRU(cfg), Conv1D(cfg), AttentionBlock(cfg), GatedMLP(cfg)]:
    boxed = jax.eval_shape(layer.init, jax.random.PRNGKey(0), *((x,) if isinstance(
        layer, GatedMLP) else (x, seg)))["params"]
    for leaf in jax.tree.leaves(boxed, is_leaf=lambda l: isinstance(l, nn.Partitioned)):
      assert isinstance(leaf, nn.LogicallyPartitioned)
      assert len(leaf.names) == leaf.value.ndim
