"""The fused attention kernels equal the XLA reference, forward and gradients.

JAX's splash attention (TPU) and Pallas GPU flash attention (Triton) run here in the
kernels' interpret mode on the CPU, against `layer.xla_attention` (the XLA path the
trainer runs without them): local windows shorter and longer than the sequence, global
attention, several documents per row, float32 and bfloat16, and on an 8-device mesh
with the heads split over `tensor`.

Tolerances: float32 to 2e-5 (the kernels' online softmax sums in another order);
bfloat16 to 2e-2 of the output's scale forward and 4e-2 of each gradient's scale (one
bf16 ulp is 7.8e-3: the kernels scale the queries in bf16 and round the probabilities
per block, the reference rounds them once).
"""
import functools
import json
import os

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.attention_options import AttentionOptions
from model.blocks.attention import fused
from model.blocks.attention import kernel_costs
from model.blocks.attention import layer
from model.scan.options import ScanOptions
from pretrain import gin_config
from pretrain.train_config import TrainConfig
from sharding import mesh as mesh_lib
from sharding.mesh import MeshConfig
from sharding import rules as rules_lib

from inprocess_trainer import train_in_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOLERANCE = {"float32": (2e-5, 2e-5), "bfloat16": (2e-2, 4e-2)}


def _inputs(batch, length, heads, head_dim, dtype, documents, seed=0):
  rng = np.random.default_rng(seed)
  queries = jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), dtype)
  keys = jnp.asarray(rng.normal(size=(batch, length, head_dim)), dtype)
  values = jnp.asarray(rng.normal(size=(batch, length, head_dim)), dtype)
  # Each row packs `documents` documents with starts at random places (one at 0).
  positions = np.zeros((batch, length), np.int32)
  for row in range(batch):
    starts = np.sort(rng.choice(np.arange(1, length), documents - 1, replace=False))
    bounds = [0, *starts, length]
    for begin, end in zip(bounds[:-1], bounds[1:]):
      positions[row, begin:end] = np.arange(end - begin)
  return queries, keys, values, jnp.asarray(positions)


def _scaled_error(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


def _loss(attention, queries, keys, values, cotangent):
  return jnp.sum(attention(queries, keys, values).astype(jnp.float32) * cotangent)


def _check(impl, batch, length, heads, head_dim, window, dtype, documents,
           options=AttentionOptions()):
  queries, keys, values, positions = _inputs(batch, length, heads, head_dim, dtype,
                                             documents)
  reference = functools.partial(layer.xla_attention, segment_pos=positions, window=window,
                                dtype=dtype)
  kernel = functools.partial(fused.fused_attention, impl, segment_pos=positions,
                             window=window, options=options, interpret=True, dtype=dtype)
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=queries.shape), jnp.float32)
  want, want_grads = jax.jit(jax.value_and_grad(
      lambda *a: _loss(reference, *a, cotangent), argnums=(0, 1, 2)))(queries, keys, values)
  got, got_grads = jax.jit(jax.value_and_grad(
      lambda *a: _loss(kernel, *a, cotangent), argnums=(0, 1, 2)))(queries, keys, values)
  forward_tol, grad_tol = TOLERANCE[dtype]
  out_want = jax.jit(reference)(queries, keys, values)
  out_got = jax.jit(kernel)(queries, keys, values)
  assert out_got.dtype == out_want.dtype == jnp.dtype(dtype)
  assert _scaled_error(out_got, out_want) < forward_tol
  for name, g, w in zip("qkv", got_grads, want_grads):
    assert g.dtype == w.dtype
    assert _scaled_error(g, w) < grad_tol, name
  assert abs(float(got) - float(want)) <= forward_tol * (abs(float(want)) + 1) * 10


@pytest.mark.parametrize("batch,length,heads,head_dim,window,dtype,documents", [
    (2, 256, 4, 32, 64, "float32", 3),      # window < T: blocks outside the band skipped
    (2, 256, 4, 32, 64, "bfloat16", 3),
    (1, 384, 2, 64, 300, "float32", 2),     # window > a block, T not a power of two
    (2, 128, 2, 32, 500, "float32", 4),     # window longer than T: causal
    (2, 256, 4, 32, None, "float32", 3),    # global attention
    (2, 256, 4, 32, None, "bfloat16", 1),
])
def test_splash_equals_xla(batch, length, heads, head_dim, window, dtype, documents):
  _check("splash", batch, length, heads, head_dim, window, dtype, documents,
         AttentionOptions(block_q=128, block_kv=128))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_equals_xla_for_global_attention(dtype):
  _check("triton", 2, 128, 2, 32, None, dtype, 3)


def test_splash_on_a_mesh_splits_heads_over_tensor():
  """On data:2,fsdp:2,tensor:2 the kernel runs per shard (batch over data x fsdp, heads
  over tensor); the one K/V head's gradient is summed over the head shards."""
  mesh = mesh_lib.create_mesh(mesh_lib.MeshConfig(data=2, fsdp=2, tensor=2))
  queries, keys, values, positions = _inputs(4, 128, 4, 16, "float32", 3)
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=queries.shape), jnp.float32)
  reference = functools.partial(layer.xla_attention, segment_pos=positions, window=32,
                                dtype="float32")
  kernel = functools.partial(fused.fused_attention, "splash", segment_pos=positions,
                             window=32, options=AttentionOptions(block_q=128, block_kv=128),
                             interpret=True, dtype="float32")
  grad = lambda f: jax.jit(jax.grad(lambda *a: _loss(f, *a, cotangent), argnums=(0, 1, 2)))
  want = grad(reference)(queries, keys, values)
  with rules_lib.activation_sharding(mesh):
    lowered = grad(kernel).lower(queries, keys, values)
    got = grad(kernel)(queries, keys, values)
  assert "shard_map" in lowered.as_text() or "sdy.manual_computation" in lowered.as_text()
  for name, g, w in zip("qkv", got, want):
    assert _scaled_error(g, w) < 2e-5, name


def test_choice_follows_options_platform_and_mesh():
  tpu, cpu, gpu = (ScanOptions(lowering_platform=p) for p in ("tpu", "cpu", "gpu"))
  auto = AttentionOptions()
  assert fused.choose(auto, tpu, 1024, 2048, None) == fused.Choice("splash")
  assert fused.choose(auto, cpu, 1024, 2048, None) == fused.Choice("xla")
  assert fused.choose(AttentionOptions(impl="xla"), tpu, 1024, 2048, None).impl == "xla"
  assert fused.choose(auto, gpu, None, 2048, None) == fused.Choice("triton")
  local_gpu = fused.choose(auto, gpu, 1024, 2048, None)
  assert local_gpu.impl == "xla" and "sliding-window" in local_gpu.reason
  split = fused.choose(auto, tpu, 1024, 2048, "sequence")
  assert split.impl == "xla" and "'sequence'" in split.reason
  for length in (2050, 64):  # no 128-row block divides it
    odd = fused.choose(auto, tpu, 1024, length, None)
    assert odd.impl == "xla" and f"{length} tokens" in odd.reason
  assert fused.kernel_block(512, 2048) == 512
  assert fused.kernel_block(512, 384) == 384
  assert fused.kernel_block(512, 640) == 128
  assert fused.kernel_block(512, 64) is None


def test_bad_options_name_the_setting():
  with pytest.raises(ValueError, match="AttentionOptions.impl"):
    AttentionOptions(impl="flash")
  with pytest.raises(ValueError, match="AttentionOptions.block_q"):
    AttentionOptions(block_q=100)


@pytest.mark.parametrize("length,window,block_q,block_kv", [
    (1024, 300, 128, 128), (2048, 1024, 512, 512), (1024, None, 256, 128),
    (512, 2000, 128, 256)])
def test_declared_costs_count_the_blocks_the_kernel_visits(length, window, block_q, block_kv):
  """`kernel_costs` prices the blocks splash's own mask processing keeps (the block masks
  its forward, dq and dkv grids read): every launch's FLOPs are those blocks' matmuls."""
  heads, rows, head_dim = 3, 2, 64
  kernel = fused.splash_kernel(length, heads, window, block_q, block_kv, True)
  visited = kernel_costs.visited_blocks(length, window, block_q, block_kv)
  for info in (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info):
    # One block mask serves every head (they are equal), and the grid runs it per head.
    assert int((np.asarray(info.block_mask) > 0).sum()) == visited
  costs = kernel_costs.splash_launch_costs(rows, heads, length, head_dim, window, block_q,
                                           block_kv, itemsize=2)
  scores = visited * heads * rows * block_q * block_kv
  assert costs["fwd"].flops == 4 * scores * head_dim
  assert costs["dq"].flops == 6 * scores * head_dim
  assert costs["dkv"].flops == 8 * scores * head_dim
  # Never free: each launch at least reads its inputs and writes its results once.
  assert all(cost.bytes >= 2 * rows * length * head_dim * 2 for cost in costs.values())


@pytest.mark.slow
def test_quickstart_model_trains_to_the_same_losses_with_splash(tmp_path):
  """The quickstart's model (6 layers, window 128, 3 heads of 64) at its shape (8 x 256)
  trains its first steps to the same losses with splash attention in interpret mode
  as with XLA's path, on data:2,fsdp:4 (its 3 heads do not split over 2): float32, within 1e-5 relative
  (the kernels' online softmax sums in another order, and Adam carries that on)."""
  gin_config.parse([os.path.join(REPO, "configs", "quickstart.gin")], [])
  try:
    model = gin_config.build_model_config()
  finally:
    gin.clear_config()
  config = TrainConfig(train_steps=4, batch_size=8, sequence_length=256,
                       checkpoint_every=100, eval_every=0, log_every=1, final_eval=False,
                       seed=0)
  losses = {}
  for impl in ("xla", "splash"):
    workdir = str(tmp_path / impl)
    options = AttentionOptions(impl=impl, block_q=128, block_kv=128)
    train_in_process(workdir, model.replace(attention=options), config,
                     mesh=MeshConfig(data=2, fsdp=4))
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
      rows = [json.loads(line) for line in f]
    losses[impl] = [row["loss"] for row in rows if "loss" in row and "kind" not in row]
  assert len(losses["xla"]) == 4
  np.testing.assert_allclose(losses["splash"], losses["xla"], rtol=1e-5)
  assert losses["xla"][-1] < losses["xla"][0]   # it trains
