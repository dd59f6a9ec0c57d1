"""Sequence parallelism inside the model: what crosses devices when the mesh splits time.

tests/test_sharded_model.py checks that the whole model on sequence meshes equals the
single-device model; this file checks *how*: in the compiled forward and backward
program of each temporal block under a (sequence 8) mesh, the RG-LRU moves only its
[shards, B, C] carries, the Conv1D a halo of at most W-1 steps, and local attention one
block of keys/values, never an all-gather of a [B, T, ...] activation. It also checks that
a prefill (return_cache=True) under the mesh gives the single-device outputs and caches
(RG-LRU, CG-LRU, local attention).
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.blocks.attention.layer import AttentionBlock
from model.config import ModelConfig
from model.blocks.gateloop.layer import GateLoopBlock
from model.blocks.recurrent.layer import RecurrentBlock
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

# T/shards = 16 (a multiple of the window, as the blocked local attention needs) and the
# channel counts (48, 6, 32, and the two gates' 12 side by side)
# differ from every other dimension, so a collective's shape says what it carries.
BATCH, LENGTH, SHARDS = 2, 128, 8
WINDOW = 4
CONFIG = ModelConfig(vocab_size=64, width=32, rnn_width=48, num_heads=8, depth=3,
                     block_pattern=("recurrent", "recurrent", "attention"),
                     attention_window=WINDOW, mlp_expansion=3)
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all",
               "reduce-scatter")
_COLLECTIVE = re.compile(r"= (.*?) (%s)(?:-start)?\(" % "|".join(COLLECTIVES))


def _collectives(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
  """(op, result shape) of every collective in a compiled HLO text, tuple results split."""
  found = []
  for line in hlo.splitlines():
    match = _COLLECTIVE.search(line)
    if match:
      for dims in re.findall(r"[a-z]\w*\[([\d,]*)\]", match.group(1)):
        found.append((match.group(2), tuple(int(d) for d in dims.split(",") if d)))
  return found


def _inputs():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH, LENGTH, CONFIG.width)).astype(np.float32)
  positions = np.tile(np.arange(LENGTH, dtype=np.int32), (BATCH, 1))
  for start in (5, 12, 32, 47):  # inside shards and on a shard boundary (32)
    positions[0, start:] = np.arange(LENGTH - start)
  return x, positions


def _mesh():
  return mesh_lib.create_mesh(mesh_lib.MeshConfig(data=1, sequence=SHARDS))


def _block_program(block, mesh):
  """Compiled HLO of the block's forward and backward pass on time-split inputs."""
  x, positions = _inputs()
  params = block.init(jax.random.PRNGKey(0), x[:, :8], positions[:, :8])

  def loss(params, x, positions):
    y, _ = block.apply(params, x, positions)
    return jnp.sum(y ** 2)

  batch = partition.make_global_batch(mesh, {"x": x, "positions": positions})
  with rules_lib.activation_sharding(mesh):
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return step.lower(params, batch["x"], batch["positions"]).compile().as_text()


def _time_dims(shape):
  """Dimensions of a collective's result that could be a shard's or the whole time axis."""
  return [d for d in shape if d in (LENGTH, LENGTH // SHARDS)]


@pytest.mark.slow
def test_recurrent_block_moves_only_carries_and_conv_halo():
  ops = _collectives(_block_program(RecurrentBlock(CONFIG), _mesh()))
  channels, halo = CONFIG.rnn_width, CONFIG.conv_width - 1
  gathers = [shape for op, shape in ops if op == "all-gather"]
  # The scan over shards: the per-shard decay products and final states, nothing else.
  assert gathers and all(shape == (SHARDS, BATCH, channels) for shape in gathers), ops
  permutes = [shape for op, shape in ops if op == "collective-permute"]
  # Conv1D halos: inputs [B, s, C] and reset flags [B, s], 1 <= s <= W-1, both ways.
  assert permutes, ops
  for shape in permutes:
    assert shape[0] == BATCH and 1 <= shape[1] <= halo and shape[2:] in ((), (channels,)), ops
  assert max(shape[1] for shape in permutes) == halo
  assert not [op for op, _ in ops if op == "all-to-all"], ops
  # Parameter-gradient sums over the shards are fine; nothing time-sized is reduced,
  # and no gradient is summed per batch row (a kernel broadcast over the batch).
  assert not [(op, shape) for op, shape in ops if _time_dims(shape)], ops
  assert not [shape for op, shape in ops
              if op == "all-reduce" and len(shape) > 1 and shape[0] == BATCH], ops


@pytest.mark.slow
def test_gateloop_moves_only_carries():
  ops = _collectives(_block_program(GateLoopBlock(CONFIG), _mesh()))
  gathers = [shape for op, shape in ops if op == "all-gather"]
  assert gathers and all(shape == (SHARDS, BATCH, CONFIG.width) for shape in gathers), ops
  assert not [(op, shape) for op, shape in ops if _time_dims(shape)], ops


@pytest.mark.slow
def test_local_attention_exchanges_one_block():
  ops = _collectives(_block_program(AttentionBlock(CONFIG), _mesh()))
  assert not [op for op, _ in ops if op in ("all-gather", "all-to-all")], ops
  permutes = [shape for op, shape in ops if op == "collective-permute"]
  # The previous block's keys and values [B, W, d] (and their gradients back), and its
  # document-start flags [B, W].
  assert permutes, ops
  assert all(shape in ((BATCH, WINDOW, CONFIG.head_dim), (BATCH, WINDOW))
             for shape in permutes), ops
  assert not [(op, shape) for op, shape in ops if _time_dims(shape)], ops


def test_global_attention_gathers_keys_and_values():
  """The documented exception: global attention all-gathers the single K/V head."""
  config = ModelConfig(vocab_size=64, width=32, rnn_width=48, num_heads=8, depth=1,
                       block_pattern=("attention",), attention_window=None)
  ops = _collectives(_block_program(AttentionBlock(config), _mesh()))
  gathered = [shape for op, shape in ops if op == "all-gather"]
  assert (BATCH, LENGTH, config.head_dim) in gathered, ops


@pytest.mark.parametrize("block_class,lru_variant", [
    (RecurrentBlock, "real"), (RecurrentBlock, "complex"), (AttentionBlock, "real"),
    (GateLoopBlock, "real")])
@pytest.mark.slow
def test_prefill_under_sequence_mesh_equals_single_device(block_class, lru_variant):
  """Outputs and decoding caches of a time-split prefill match the unsplit ones."""
  block = block_class(dataclasses.replace(CONFIG, lru_variant=lru_variant))
  x, positions = _inputs()
  params = block.init(jax.random.PRNGKey(1), x[:, :8], positions[:, :8])
  prefill = lambda p, x, pos: block.apply(p, x, pos, return_cache=True)
  expected = jax.jit(prefill)(params, x, positions)
  mesh = _mesh()
  batch = partition.make_global_batch(mesh, {"x": x, "positions": positions})
  with rules_lib.activation_sharding(mesh):
    actual = jax.jit(prefill)(params, batch["x"], batch["positions"])
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(actual),
                               jax.tree_util.tree_leaves(expected)):
    got, want = np.asarray(got), np.asarray(want)
    scale = np.abs(want).max() + 1e-30
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("length", [10, 13, 16])
def test_blocked_local_attention_equals_full_matrix(length):
  """Blocked local attention (cache-less calls, T > window, T padded to whole blocks)
  equals the full-matrix path, reached here by prefilling through an empty cache."""
  config = dataclasses.replace(CONFIG, width=16, num_heads=2, block_pattern=("attention",))
  block = AttentionBlock(config)
  rng = np.random.default_rng(length)
  x = rng.normal(size=(2, length, config.width)).astype(np.float32)
  positions = np.tile(np.arange(length, dtype=np.int32), (2, 1))
  for start in (3, 4, 9):  # documents shorter than, equal to and longer than a block
    positions[1, start:] = np.arange(length - start)
  params = block.init(jax.random.PRNGKey(2), x[:, :1], positions[:, :1])
  params = jax.tree.map(lambda p: p + 0.1, params)  # non-trivial biases and weights
  blocked, _ = block.apply(params, x, positions)
  empty = AttentionBlock.init_cache(config, 2, jnp.float32)
  full, _ = block.apply(params, x, positions, cache=empty)
  np.testing.assert_allclose(np.asarray(blocked), np.asarray(full), rtol=1e-5, atol=1e-5)
