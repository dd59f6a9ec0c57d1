"""Fused attention for training calls: JAX's flash kernels, chosen per call and mesh.

A fused kernel computes softmax(QKᵀ/√d)V block by block with an online softmax, so the
[T, S] scores live only in on-chip memory; the backward pass recomputes them from the
saved log-sum-exp. Two kernels of JAX's own are wired in (`model.attention_options`
says which runs where):

- splash attention (TPU, `jax.experimental.pallas.ops.tpu.splash_attention`): the
  multi-query variant, with a `LocalMask` (keys t-w … t, as the XLA path's window) or a
  `CausalMask`, and document masks as segment ids. Blocks the mask rules out entirely
  are skipped, so local attention costs about (w + block)·T scores, not T².
- Pallas GPU flash attention (Triton, `jax.experimental.pallas.ops.gpu.attention`):
  causal with segment ids; it has no window, so only global attention uses it.

Documents: a row's positions restart at 0 where a document starts (`segment_pos`);
the running count of those starts is a segment id, and a query may see a key only of
its own segment, which is the XLA path's "key at or after the document start" rule
(tokens before a row's first start form one segment, as they share start 0 there).

Scaling: the kernels take no softmax scale (splash) or apply it to float32 scores
(Triton); queries are scaled by 1/√d in float32 before the kernel and cast back to the
compute dtype, the XLA path scales float32 logits. In float32 the two agree to
rounding; in bfloat16 the query rounding adds one bf16 ulp of relative error to the
logits (tests/test_attention_fused.py states the tolerances).

Meshes: the kernels carry no partitioning rule, so they run inside `shard_map` over
the layout the logical-axis rules give the queries (batch over data/fsdp, heads over
`tensor`); the single K/V head is replicated over `tensor`, and the transpose of
`shard_map` sums its gradient over the head shards. A mesh that splits time runs the
XLA path (its blocked local attention exchanges a one-block halo; the kernels would
need the whole sequence of keys), and `choose` says so in one line for the plan.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from model import partitioning as P
from model.attention_options import AttentionOptions
from model.scan.options import VERIFIED_CUDA_CAPABILITIES
from model.scan.options import kernel_target

_LANES = 128  # the TPU's lane width: splash's blocks are multiples of it


class Choice(NamedTuple):
  """The implementation a training call runs, and why, for the plan and the report.

  Attributes:
    impl: "xla", "splash" or "triton".
    reason: one line when the call runs something other than what `AttentionOptions`
      asked for (or "auto" settled on XLA), else "".
  """
  impl: str
  reason: str = ""


def kernel_block(preferred: int, length: int) -> Optional[int]:
  """The block rows for a `length`-token sequence: `preferred` if it divides it, else
  the largest multiple of 128 below it that does; None when none does (splash's key
  blocks are whole multiples of the 128-lane width, so shorter rows run XLA)."""
  for block in range(preferred, _LANES - 1, -_LANES):
    if length % block == 0:
      return block
  return None


def _local_gpu_verified() -> bool:
  """Whether this host's GPU is of a generation whose compiler built the Triton kernels
  in tests/test_gpu_compile.py."""
  capability = getattr(jax.local_devices()[0], "compute_capability", None)
  return capability in VERIFIED_CUDA_CAPABILITIES["triton"]


def _auto(window: Optional[int], target: Optional[str], cross_lowering: bool) -> Choice:
  """What "auto" runs on `target` (`model.attention_options`, "auto")."""
  if target == "tpu":
    return Choice("splash")
  if target == "gpu":
    if window is not None:
      return Choice("xla", "local attention on GPU runs XLA's blocked path: JAX's "
                           "Pallas GPU flash attention has no sliding-window mask")
    if cross_lowering or _local_gpu_verified():
      return Choice("triton")
    return Choice("xla", "this GPU generation's compiler has not built the Triton "
                         "attention kernel in this project's tests")
  return Choice("xla")


def choose(options: AttentionOptions, scan_options: Any, window: Optional[int],
           length: int, time_split: Optional[str]) -> Choice:
  """The implementation of a cache-less call of `length` tokens.

  Args:
    options: the model's `AttentionOptions`.
    scan_options: the model's `ScanOptions`, whose `lowering_platform` names the target
      (the whole program is lowered for one platform).
    window: the attention window (None = global).
    length: tokens per row.
    time_split: the mesh axis that splits time, if any.
  """
  target = kernel_target(scan_options)
  if options.impl == "xla":
    return Choice("xla")
  if options.impl == "auto":
    choice = _auto(window, target, scan_options.lowering_platform is not None)
  else:
    choice = Choice(options.impl)
  if choice.impl == "xla":
    return choice
  if choice.impl == "triton" and window is not None:
    return Choice("xla", "the Triton attention kernel has no sliding-window mask; local "
                         "attention runs XLA's blocked path")
  if time_split is not None:
    return Choice("xla", f"the mesh splits time over {time_split!r}: the fused kernels "
                         "need every key of a row, so attention runs XLA's path")
  if (kernel_block(options.block_q, length) is None
      or kernel_block(options.block_kv, length) is None):
    return Choice("xla", f"{length} tokens per row is not a multiple of 128: no kernel "
                         "block fits, attention runs XLA's path")
  return choice


def interpret_mode(options: AttentionOptions, scan_options: Any) -> bool:
  """Interpret mode exactly when the target platform is CPU, unless set."""
  if options.interpret is not None:
    return options.interpret
  return kernel_target(scan_options) == "cpu"


def segment_ids(segment_pos: jax.Array) -> jax.Array:
  """int32 [B, T]: the running count of document starts (module docstring)."""
  return jnp.cumsum(segment_pos == 0, axis=1, dtype=jnp.int32)


def splash_kernel(length: int, heads: int, window: Optional[int], block_q: int,
                  block_kv: int, interpret: bool):
  """The splash MQA kernel of one shape and mask. Built in each trace that calls it: its
  block masks are numpy work whose arrays become the trace's constants, so a kernel
  kept across traces would carry one trace's values into another."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm  # pylint: disable=g-import-not-at-top
  shape = (length, length)
  mask = sm.CausalMask(shape) if window is None else sm.LocalMask(shape, (window, 0), 0)
  blocks = sk.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                         block_q_dkv=block_q, block_kv_dkv=block_kv,
                         block_kv_dkv_compute=block_kv, block_q_dq=block_q,
                         block_kv_dq=block_kv)
  return sk.make_splash_mqa_single_device(sm.MultiHeadMask([mask] * heads),
                                          block_sizes=blocks, interpret=interpret)


def _splash(queries, keys, values, segments, *, window, options, interpret):
  """Splash MQA on one shard: queries [b, T, n, d] (scaled), keys/values [b, T, d]."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk  # pylint: disable=g-import-not-at-top
  _, length, heads, _ = queries.shape
  kernel = splash_kernel(length, heads, window, kernel_block(options.block_q, length),
                         kernel_block(options.block_kv, length), interpret)
  per_row = jax.vmap(kernel, in_axes=(0, 0, 0, sk.SegmentIds(0, 0)))
  out = per_row(queries.transpose(0, 2, 1, 3), keys, values,
                sk.SegmentIds(segments, segments))
  return out.transpose(0, 2, 1, 3)


def _triton(queries, keys, values, segments, *, options, interpret):
  """Pallas GPU flash attention on one shard (causal, segment ids); the one K/V head is
  broadcast to the query heads, as the kernel reads one K/V head per query head."""
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention  # pylint: disable=g-import-not-at-top
  _, length, heads, _ = queries.shape
  broadcast = lambda x: jnp.broadcast_to(x[:, :, None], x.shape[:2] + (heads,) + x.shape[2:])
  # JAX's defaults (128-row forward blocks, 32-row backward ones, sized for shared
  # memory), the forward ones no larger than the options'.
  blocks = dataclasses.replace(
      gpu_attention.BlockSizes.get_default(),
      block_q=min(kernel_block(options.block_q, length), _LANES),
      block_k=min(kernel_block(options.block_kv, length), _LANES))
  return gpu_attention.mha(queries, broadcast(keys), broadcast(values), segments,
                           sm_scale=1.0, causal=True, block_sizes=blocks,
                           interpret=interpret)


def fused_attention(impl: str, queries: jax.Array, keys: jax.Array, values: jax.Array,
                    segment_pos: jax.Array, window: Optional[int],
                    options: AttentionOptions, interpret: bool, dtype: Any) -> jax.Array:
  """Masked MQA of a training call through a fused kernel, on the mesh in scope.

  Args:
    impl: "splash" or "triton" (`choose`).
    queries: [B, T, N, d] with RoPE applied; keys, values: [B, T, d].
    segment_pos: int [B, T]; 0 starts a document.
    window: keys t-window … t are seen (None = global, causal).
    options: block sizes.
    interpret: run the kernel in interpret mode (CPU).
    dtype: compute dtype of the kernel's inputs and output.

  Returns:
    [B, T, N, d] in `dtype`, the XLA path's result up to rounding.
  """
  scale = queries.shape[-1] ** -0.5
  queries = (queries.astype(jnp.float32) * scale).astype(dtype)
  keys, values = keys.astype(dtype), values.astype(dtype)
  segments = segment_ids(segment_pos)
  if impl == "splash":
    local = functools.partial(_splash, window=window, options=options, interpret=interpret)
  else:
    local = functools.partial(_triton, options=options, interpret=interpret)
  layout = P.shard_layout(queries.shape, (P.BATCH, P.LENGTH, P.ACT_HEADS, None))
  if layout is None:
    return local(queries, keys, values, segments)
  spec = layout.spec
  kv_spec = jax.sharding.PartitionSpec(spec[0], spec[1], None)
  row_spec = jax.sharding.PartitionSpec(spec[0], spec[1])
  # No replication check: Pallas calls carry no replication rule.
  return jax.shard_map(local, mesh=layout.mesh, in_specs=(spec, kv_spec, kv_spec, row_spec),
                       out_specs=spec, check_vma=False)(queries, keys, values, segments)
