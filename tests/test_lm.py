"""The language model: parameter tree and logical axes, document isolation, bf16, remat,
soft cap, gradients, and program size independent of depth (scanned layers)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import lm
from model.config import ModelConfig

GRIFFIN = ModelConfig(vocab_size=64, width=32, rnn_width=48, num_heads=2, depth=5,
                      attention_window=4, logits_soft_cap=None)


def tokens_and_positions(lengths, seed=0, vocab=64):
  """One row per entry of `lengths`, each a list of packed document lengths."""
  rng = np.random.default_rng(seed)
  total = sum(lengths[0])
  tokens = rng.integers(0, vocab, size=(len(lengths), total)).astype(np.int32)
  positions = np.asarray([np.concatenate([np.arange(n) for n in row]) for row in lengths],
                         np.int32)
  return jnp.asarray(tokens), jnp.asarray(positions)


@functools.lru_cache(maxsize=None)
def _jitted_forward(config):
  return jax.jit(lambda p, t, q: lm.LanguageModel(config).apply({"params": p}, t, q)[0])


def forward(config, params, tokens, positions):
  return _jitted_forward(config)(params, tokens, positions)


@pytest.fixture(scope="module")
def griffin_params():
  return lm.init_params(GRIFFIN, jax.random.PRNGKey(0))


@pytest.mark.slow
def test_params_and_logical_axes_have_the_same_tree(griffin_params):
  axes = lm.param_logical_axes(GRIFFIN)
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
  assert (jax.tree.structure(griffin_params)
          == jax.tree.structure(axes, is_leaf=is_spec))
  for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(griffin_params),
                                jax.tree.leaves(axes, is_leaf=is_spec)):
    name = jax.tree_util.keystr(path)
    assert leaf.dtype == jnp.float32 and len(spec) == leaf.ndim, name
    if name.startswith("['blocks']"):
      assert spec[0] == "layers" and leaf.shape[0] == GRIFFIN.num_scanned_units, name
    else:
      assert "layers" not in spec, name
  # depth 5 = one scanned (R, R, A) unit + a trailing (R, R).
  assert set(griffin_params) == {"embedder", "blocks", "remainder_0", "remainder_1",
                                 "final_norm"}
  assert set(griffin_params["blocks"]["block_2"]) == {"temporal_norm", "attention",
                                                      "mlp_norm", "mlp"}


def test_logical_axes_of_a_7b_model_need_no_memory():
  big = ModelConfig(vocab_size=256_000, width=4096, rnn_width=5632, num_heads=32,
                    num_gate_blocks=16, depth=32)
  axes = lm.param_logical_axes(big)
  gate = axes["blocks"]["block_0"]["recurrent"]["rg_lru"]["a_gate"]["kernel"]
  assert tuple(gate) == ("layers", "rnn_heads", "rnn_head_dim", None)
  assert tuple(axes["embedder"]["embedding"]) == ("vocab", "embed")


def test_packed_documents_do_not_see_each_other(griffin_params):
  """A document's logits depend only on its own tokens, wherever it is packed."""
  rng = np.random.default_rng(1)
  doc_a, doc_b, other_a, other_b = (rng.integers(0, 64, n) for n in (7, 9, 7, 9))
  tokens = jnp.asarray(np.stack([np.concatenate(pair) for pair in
                                 [(doc_a, doc_b), (doc_a, other_b), (other_a, doc_b),
                                  (doc_a, doc_b)]]), jnp.int32)
  in_doc = np.concatenate([np.arange(7), np.arange(9)])
  positions = jnp.asarray(np.stack([in_doc] * 3 + [np.arange(16)]), jnp.int32)
  logits = forward(GRIFFIN, griffin_params, tokens, positions)
  # B after A equals B after another document; A is unaffected by what follows.
  np.testing.assert_allclose(logits[0, 7:], logits[2, 7:], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(logits[0, :7], logits[1, :7], atol=1e-5, rtol=1e-5)
  # Without the document start, B does see A (so the comparison above is not vacuous).
  assert not np.allclose(logits[3, 7:], logits[0, 7:], atol=1e-3)


@pytest.mark.slow
def test_bfloat16_forward_is_close_to_float32(griffin_params):
  """bf16 compute (float32 params) stays within bf16 round-off of the float32 forward.

  Each bf16 matmul stage adds ~0.3% relative noise per logit (2^-9 rounding of its
  inputs), so the logits agree to ~1-2% and the loss (a smooth average) to far better.
  """
  tokens, positions = tokens_and_positions([[10, 6], [16]], seed=2)
  full = forward(GRIFFIN, griffin_params, tokens, positions)
  half = forward(GRIFFIN.replace(dtype="bfloat16"), griffin_params, tokens, positions)
  assert half.dtype == jnp.float32
  full, half = np.asarray(full, np.float64), np.asarray(half, np.float64)
  assert np.linalg.norm(half - full) / np.linalg.norm(full) < 2e-2
  log_partition = lambda l: np.log(np.exp(l).sum(-1)).mean()
  assert abs(log_partition(half) - log_partition(full)) < 1e-2 * abs(log_partition(full))


@pytest.mark.slow
def test_soft_cap_and_embedding_scale(griffin_params):
  tokens, positions = tokens_and_positions([[12]], seed=3)
  cfg = GRIFFIN.replace(embeddings_scale_by_sqrt_dim=True)
  raw = forward(cfg, griffin_params, tokens, positions)
  capped = forward(cfg.replace(logits_soft_cap=0.5), griffin_params, tokens, positions)
  np.testing.assert_allclose(capped, 0.5 * np.tanh(np.asarray(raw) / 0.5), atol=1e-6)
  assert np.abs(raw).max() > 0.5 >= np.abs(capped).max()


def loss_fn(config):
  def loss(params, tokens, positions):
    logits, _ = lm.LanguageModel(config).apply({"params": params}, tokens, positions)
    return jnp.mean(jax.nn.logsumexp(logits, -1)
                    - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0])
  return loss


@functools.lru_cache(maxsize=None)
def _jitted_grad(config):
  return jax.jit(jax.grad(loss_fn(config)))


@pytest.mark.slow
def test_remat_policies_give_identical_gradients(griffin_params):
  tokens, positions = tokens_and_positions([[5, 11]], seed=4)
  reference = _jitted_grad(GRIFFIN)(griffin_params, tokens, positions)
  for policy in ("full", "save_matmuls"):
    grads = _jitted_grad(GRIFFIN.replace(remat=policy))(griffin_params, tokens, positions)
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(grads)):
      np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_unrolled_depth_scan_gives_identical_gradients():
  config = GRIFFIN.replace(depth=7, width=16, rnn_width=16)  # 2 scanned units + 1 block
  assert config.depth_unroll == 2                  # the default unrolls 7 layers
  assert config.replace(depth=13).depth_unroll == 1     # and scans beyond 12
  params = lm.init_params(config, jax.random.PRNGKey(1))
  tokens, positions = tokens_and_positions([[9, 7]], seed=5)
  reference = _jitted_grad(config.replace(depth_scan_unroll=1))(params, tokens, positions)
  unrolled = _jitted_grad(config)(params, tokens, positions)
  for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(unrolled)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_gradient_matches_finite_differences(griffin_params):
  tokens, positions = tokens_and_positions([[5, 11]], seed=4)
  grad = _jitted_grad(GRIFFIN)(griffin_params, tokens, positions)
  loss = jax.jit(loss_fn(GRIFFIN))
  rng = np.random.default_rng(0)
  direction = jax.tree.map(lambda p: rng.normal(size=p.shape), griffin_params)
  norm = np.sqrt(sum(np.sum(d ** 2) for d in jax.tree.leaves(direction)))
  direction = jax.tree.map(lambda d: jnp.asarray(d / norm, jnp.float32), direction)
  analytic = sum(float(jnp.vdot(g, d)) for g, d in
                 zip(jax.tree.leaves(grad), jax.tree.leaves(direction)))
  # A unit-norm step of 0.03 balances float32 round-off against truncation error.
  eps = 3e-2
  shifted = lambda s: jax.tree.map(lambda p, d: p + s * eps * d, griffin_params, direction)
  numeric = (float(loss(shifted(1), tokens, positions))
             - float(loss(shifted(-1), tokens, positions))) / (2 * eps)
  assert analytic == pytest.approx(numeric, rel=2e-3)


@pytest.mark.slow
def test_program_size_does_not_grow_with_depth():
  """The lowered forward+backward of depth 48 is < 1.5x the size of depth 12."""
  tokens, positions = tokens_and_positions([[8]], seed=6)

  def program_size(depth):
    cfg = GRIFFIN.replace(depth=depth, width=16, rnn_width=16, remat="full",
                          depth_scan_unroll=1)
    params = jax.eval_shape(lambda: lm.init_params(cfg, jax.random.PRNGKey(0)))
    lowered = jax.jit(jax.grad(loss_fn(cfg))).lower(params, tokens, positions)
    return len(lowered.as_text())

  assert program_size(48) < 1.5 * program_size(12)
