"""The model on real meshes of 8 simulated devices equals the single-device model.

For each mesh, a tiny Griffin (and on two meshes a tiny Hawk) computes logits and
parameter gradients with parameters, batch and activations laid out by the default
rules; they must match the unsharded computation (float32, 1e-5 relative), and every
parameter array must be split across devices exactly as the rules say. The sequence
meshes split time, with packed documents starting inside shards and exactly on shard
boundaries.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import lm
from model.config import ModelConfig
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

P = jax.sharding.PartitionSpec

# Widths divisible by 8 everywhere a rule shards (vocab, embed, mlp, rnn, heads).
CONFIGS = {
    "griffin": ModelConfig(vocab_size=64, width=32, rnn_width=32, num_heads=8, depth=3,
                           block_pattern=("recurrent", "recurrent", "attention"),
                           attention_window=4, mlp_expansion=3),
    "hawk": ModelConfig(vocab_size=64, width=32, rnn_width=32, num_heads=8, depth=2,
                        block_pattern=("recurrent",), attention_window=None, mlp_expansion=3),
}
MESHES = {
    "data8": dict(data=8),
    "fsdp8": dict(data=1, fsdp=8),
    "tensor8": dict(data=1, tensor=8),
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
    "data2_tensor4": dict(data=2, tensor=4),
    # Sequence parallelism: the RG-LRU scans over shards, Conv1D and local attention
    # exchange halos (8 tokens = 2 attention blocks per shard on the first mesh).
    "sequence8": dict(data=1, sequence=8),
    "data2_sequence2_tensor2": dict(data=2, sequence=2, tensor=2),
}
BATCH, LENGTH = 8, 64
# Document starts per row (position 0) besides t = 0: inside shards, exactly on the
# boundaries of 8- and 32-token shards, documents spanning several shards, one-token
# documents; the last rows are random.
DOCUMENT_STARTS = ([], [5, 8, 19, 32, 33, 50], [31, 40], [3, 4, 16, 17, 45, 63],
                   [7, 9, 24, 56])


def _inputs():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, size=(BATCH, LENGTH), dtype=np.int32)
  starts = list(DOCUMENT_STARTS) + [
      sorted(rng.choice(np.arange(1, LENGTH), size=6, replace=False))
      for _ in range(BATCH - len(DOCUMENT_STARTS))]
  positions = np.zeros((BATCH, LENGTH), np.int32)
  for row, row_starts in enumerate(starts):
    for start, end in zip([0] + list(row_starts), list(row_starts) + [LENGTH]):
      positions[row, start:end] = np.arange(end - start)
  targets = np.roll(tokens, -1, axis=1)
  return tokens, positions, targets


def _loss_and_logits(config, params, tokens, positions, targets):
  logits, _ = lm.LanguageModel(config).apply({"params": params}, tokens, positions)
  logp = jax.nn.log_softmax(logits)
  loss = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
  return loss, logits


def _step(config):
  return jax.value_and_grad(functools.partial(_loss_and_logits, config), has_aux=True)


@functools.lru_cache(maxsize=None)
def _reference(name):
  config = CONFIGS[name]
  params = lm.init_params(config, jax.random.PRNGKey(1))
  device = jax.devices()[0]
  params = jax.device_put(params, device)
  (loss, logits), grads = jax.jit(_step(config))(params, *map(jnp.asarray, _inputs()))
  return params, jax.device_get(loss), jax.device_get(logits), jax.device_get(grads)


def _assert_close(actual, expected, what):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  scale = np.abs(expected).max() + 1e-30
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * scale, err_msg=what)
  error = np.linalg.norm(actual - expected) / (np.linalg.norm(expected) + 1e-30)
  assert error < 1e-5, f"{what}: relative error {error:.2e}"


def _expected_spec(logical):
  return rules_lib.logical_to_mesh_spec(logical)


# The fast tier keeps one case that splits batch, time and channels at once.
FAST_CASE = ("griffin", "data2_sequence2_tensor2")
# Griffin's recurrent blocks are Hawk's, so Griffin runs on every mesh and Hawk only where
# its pure-recurrent stack differs: time split with no attention halo, and FSDP with
# tensor parallelism.
HAWK_MESHES = ("sequence8", "data2_fsdp2_tensor2")
CASES = [pytest.param(model_name, mesh_name, id=f"{model_name}-{mesh_name}",
                      marks=() if (model_name, mesh_name) == FAST_CASE else pytest.mark.slow)
         for model_name in CONFIGS for mesh_name in MESHES
         if model_name == "griffin" or mesh_name in HAWK_MESHES]


@pytest.mark.parametrize("model_name, mesh_name", CASES)
def test_sharded_model_equals_single_device(model_name, mesh_name):
  config = CONFIGS[model_name]
  mesh = mesh_lib.create_mesh(mesh_lib.MeshConfig(**MESHES[mesh_name]))
  ref_params, ref_loss, ref_logits, ref_grads = _reference(model_name)
  logical = lm.param_logical_axes(config)
  shardings = partition.param_shardings(mesh, logical, ref_params)
  params = jax.device_put(ref_params, shardings)

  # The parameters are laid out as the rules say, on the real arrays.
  flat_logical = dict(jax.tree_util.tree_leaves_with_path(
      logical, is_leaf=lambda x: isinstance(x, P)))
  sharded_any = False
  for path, array in jax.tree_util.tree_leaves_with_path(params):
    where = partition.path_str(path)
    expected = _expected_spec(flat_logical[path])
    assert array.sharding.spec == expected, where
    assert array.sharding.mesh == mesh, where
    shard_shape = array.addressable_shards[0].data.shape
    for dim, entry in enumerate(expected):
      axes = () if entry is None else ((entry,) if isinstance(entry, str) else entry)
      shards = int(np.prod([mesh.shape[a] for a in axes]))
      assert shard_shape[dim] * shards == array.shape[dim], where
      sharded_any |= shards > 1
  # Parameters are split only over fsdp and tensor (data and sequence replicate them).
  if mesh.shape["fsdp"] * mesh.shape["tensor"] > 1:
    assert sharded_any

  batch = partition.make_global_batch(
      mesh, dict(zip(("tokens", "positions", "targets"), _inputs())))
  with rules_lib.activation_sharding(mesh):
    step = jax.jit(_step(config), out_shardings=((None, None), shardings))
    (loss, logits), grads = step(params, batch["tokens"], batch["positions"], batch["targets"])

  # The activation constraints really shard the logits: batch over the data axes, time
  # over sequence, vocab over tensor.
  assert logits.sharding.is_equivalent_to(
      jax.sharding.NamedSharding(mesh, _expected_spec(P("batch", "length", "act_vocab"))), 3)
  _assert_close(loss, ref_loss, "loss")
  _assert_close(logits, ref_logits, "logits")
  for (path, grad), (_, ref) in zip(jax.tree_util.tree_leaves_with_path(grads),
                                    jax.tree_util.tree_leaves_with_path(ref_grads)):
    _assert_close(grad, ref, f"grad {partition.path_str(path)}")

