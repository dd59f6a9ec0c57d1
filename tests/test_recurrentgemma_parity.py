"""Our model equals RecurrentGemma (the numerical reference) on mapped parameters.

Random reference weights (its own init, then biases, norm scales and a_param perturbed so
that zero-initialised parameters cannot hide a mapping mistake), packed rows holding
several documents (segment positions restarting at 0), a local window shorter than the
row, several heads, and a depth that leaves a trailing partial unit of the block pattern
(so both the scanned stack and the unscanned remainder are mapped).
"""
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recurrentgemma import common
from recurrentgemma.jax import griffin

from model import lm
from model import recurrentgemma_params as rg_params
from model.config import ModelConfig
from pretrain import gin_config
from recurrentgemma_helpers import perturbed

R, A = common.TemporalBlockType.RECURRENT, common.TemporalBlockType.ATTENTION
BATCH, LENGTH, VOCAB = 2, 32, 128

CASES = {
    # Griffin: R, R, A scanned once plus a trailing R; √D embeddings and a soft cap.
    "griffin": dict(block_types=(R, R, A, R), width=64, lru_width=96, num_heads=4,
                    window=8, scale=True, soft_cap=30.0),
    # Hawk: three scanned recurrent layers, no embedding scale, no cap.
    "hawk": dict(block_types=(R, R, R), width=64, lru_width=64, num_heads=4,
                 window=8, scale=False, soft_cap=None),
}


def _segment_positions() -> jax.Array:
  """Row 0 packs three documents (12, 10, 10 tokens); row 1 has a document cut at 5."""
  row0 = np.concatenate([np.arange(12), np.arange(10), np.arange(10)])
  row1 = np.concatenate([np.arange(3, 8), np.arange(27)])  # starts mid-document
  return jnp.asarray(np.stack([row0, row1]), jnp.int32)


def _loss(logits, targets):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))


class Case:
  """A reference model, its perturbed weights and everything computed from them once."""

  def __init__(self, name):
    self.spec = spec = CASES[name]
    self.reference_config = common.GriffinConfig(
        vocab_size=VOCAB, width=spec["width"], mlp_expanded_width=3 * spec["width"],
        num_heads=spec["num_heads"], block_types=spec["block_types"],
        embeddings_scale_by_sqrt_dim=spec["scale"],
        attention_window_size=spec["window"], logits_soft_cap=spec["soft_cap"] or 0.0,
        lru_width=spec["lru_width"], scan_type=common.ScanType.LINEAR_NATIVE)
    self.tokens = jax.random.randint(jax.random.PRNGKey(1), (BATCH, LENGTH), 0, VOCAB)
    self.targets = jax.random.randint(jax.random.PRNGKey(2), (BATCH, LENGTH), 0, VOCAB)
    self.positions = _segment_positions()
    reference = griffin.Griffin(self.reference_config, gradient_checkpointing=False)
    dummy = jnp.zeros((1, 1), jnp.int32)  # shapes only; a short trace keeps init cheap
    init = jax.jit(reference.init)(jax.random.PRNGKey(0), dummy, dummy)
    self.reference_params = perturbed(init["params"], jax.random.PRNGKey(3))
    self.config = rg_params.config_from_recurrentgemma_params(
        self.reference_params, window=spec["window"], logits_soft_cap=spec["soft_cap"],
        embeddings_scale_by_sqrt_dim=spec["scale"])
    self.params = rg_params.recurrentgemma_to_ours(self.reference_params, self.config)

    def reference_loss(params, dtype):
      model = griffin.Griffin(self.reference_config, gradient_checkpointing=False,
                              dtype=dtype)
      logits, _ = model.apply({"params": params}, self.tokens, self.positions,
                              return_cache=False)
      return _loss(logits.astype(jnp.float32), self.targets), logits

    def our_loss(params, config):
      logits, _ = lm.LanguageModel(config).apply({"params": params}, self.tokens,
                                                 self.positions)
      return _loss(logits, self.targets), logits

    grad = lambda f: jax.jit(jax.value_and_grad(f, has_aux=True), static_argnums=1)
    (_, self.reference_logits), self.reference_grads = grad(reference_loss)(
        self.reference_params, jnp.float32)
    (_, self.logits), self.grads = grad(our_loss)(self.params, self.config)
    forward = lambda f: jax.jit(lambda p, c: f(p, c)[1], static_argnums=1)
    self.reference_logits_bf16 = forward(reference_loss)(self.reference_params, jnp.bfloat16)
    self.logits_bf16 = forward(our_loss)(self.params, self.config.replace(dtype="bfloat16"))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
  return Case(request.param)


def _relative_error(actual, expected) -> float:
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


@pytest.mark.slow
def test_config_is_read_from_the_tree(case):
  spec, config = case.spec, case.config
  assert config.width == spec["width"] and config.rnn_width == spec["lru_width"]
  assert config.num_heads == spec["num_heads"] and config.gate_blocks == spec["num_heads"]
  assert config.depth == len(spec["block_types"]) and config.vocab_size == VOCAB
  expected_types = tuple("recurrent" if t == R else "attention" for t in spec["block_types"])
  assert config.block_types == expected_types
  assert config.mlp_expansion == 3 and config.conv_width == 4
  assert config.embeddings_scale_by_sqrt_dim == spec["scale"]
  assert config.logits_soft_cap == spec["soft_cap"]


@pytest.mark.slow
def test_mapped_tree_has_our_structure_and_shapes(case):
  ours = jax.eval_shape(lambda: lm.init_params(case.config, jax.random.PRNGKey(0)))
  assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(case.params)
  for (path, expected), actual in zip(jax.tree_util.tree_flatten_with_path(ours)[0],
                                      jax.tree_util.tree_leaves(case.params)):
    assert expected.shape == actual.shape, jax.tree_util.keystr(path)


@pytest.mark.slow
def test_float32_logits_match_reference(case):
  assert np.all(np.isfinite(case.logits))
  assert _relative_error(case.logits, case.reference_logits) < 1e-5


@pytest.mark.slow
def test_gradients_match_reference(case):
  mapped_back = rg_params.ours_to_recurrentgemma(case.grads, case.config)
  reference = jax.tree_util.tree_flatten_with_path(case.reference_grads)[0]
  assert (jax.tree_util.tree_structure(mapped_back)
          == jax.tree_util.tree_structure(case.reference_grads))
  for (path, expected), actual in zip(reference, jax.tree_util.tree_leaves(mapped_back)):
    assert np.max(np.abs(expected)) > 0, f"{jax.tree_util.keystr(path)} gets no gradient"
    error = _relative_error(actual, expected)
    assert error < 1e-4, f"{jax.tree_util.keystr(path)}: relative error {error:.2e}"


@pytest.mark.slow
def test_bfloat16_logits_match_reference(case):
  """A bf16 forward is within 1e-2 of the float32 reference (relative Frobenius norm).

  bf16 rounding compounds over the layers: the reference's own bf16 forward is about
  1e-2 from its float32 forward here (it also rounds the logits and the RG-LRU
  coefficients to bf16, which we keep in float32; ours measures about 0.8e-2). Two bf16
  forwards may therefore differ by up to the sum of two such errors, hence 2e-2 against
  the reference's bf16 logits, elementwise relative to their largest magnitude.
  """
  logits, reference = (np.asarray(x, np.float64) for x in (case.logits_bf16,
                                                            case.reference_logits))
  assert np.linalg.norm(logits - reference) / np.linalg.norm(reference) < 1e-2
  assert _relative_error(case.logits_bf16, case.reference_logits_bf16) < 2e-2


@pytest.mark.slow
def test_round_trips_are_the_identity(case):
  theirs = rg_params.ours_to_recurrentgemma(case.params, case.config)
  ours_again = rg_params.recurrentgemma_to_ours(theirs, case.config)
  for tree, original in ((theirs, case.reference_params), (ours_again, case.params)):
    assert jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(original)
    for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(original)):
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("preset, gin_file", [
    (common.Preset.RECURRENT_GEMMA_2B_V1, "configs/models/recurrentgemma_2b.gin"),
    (common.Preset.RECURRENT_GEMMA_9B_V1, "configs/models/recurrentgemma_9b.gin"),
])
def test_config_of_released_shapes_equals_our_preset(preset, gin_file):
  """The shapes of the released checkpoints imply exactly our RecurrentGemma presets."""
  import gin
  reference_config = common.GriffinConfig.from_preset(preset)
  shapes = jax.eval_shape(
      griffin.Griffin(reference_config, gradient_checkpointing=False).init,
      jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32))
  config = rg_params.config_from_recurrentgemma_params(
      shapes, window=reference_config.attention_window_size,
      logits_soft_cap=reference_config.logits_soft_cap,
      embeddings_scale_by_sqrt_dim=reference_config.embeddings_scale_by_sqrt_dim,
      dtype="bfloat16")
  gin_config.parse([gin_file], [])
  try:
    assert config == gin_config.build(ModelConfig)
  finally:
    gin.clear_config()


@pytest.mark.slow
def test_mismatched_config_is_rejected(case):
  shorter = case.config.replace(depth=case.config.depth - 1)
  with pytest.raises(ValueError, match="block_types"):
    rg_params.recurrentgemma_to_ours(case.reference_params, shorter)


def test_tree_that_is_not_recurrentgemma_is_rejected():
  with pytest.raises(ValueError, match="blocks.0"):
    rg_params.config_from_recurrentgemma_params(
        {"embedder": {}}, window=8, logits_soft_cap=None, embeddings_scale_by_sqrt_dim=False)
