"""What layers that look back along time share: document starts and delayed copies.

Both the recurrent block's Conv1D and local attention's blocked path read inputs a few
steps back and must not read across a document start, so the two helpers they need sit
here at the model's centre rather than in either block: `document_starts` (the running
index at which each token's document began) and `delayed` (an activation shifted along
time, with a one-`ppermute` halo exchange when the mesh splits time).
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from model import partitioning as P


def document_starts(segment_pos: jax.Array, index: jax.Array,
                    before: jax.Array | int) -> jax.Array:
  """Index at which each token's document starts.

  Args:
    segment_pos: int [B, T] position of each token in its document (0 starts one).
    index: int [B, T] (or [T]) running index of each token.
    before: int [B] or scalar: document start in force before the first token.

  Returns:
    int32 [B, T]: the running index of the latest document start at or before each token.
  """
  before = jnp.broadcast_to(jnp.asarray(before, jnp.int32).reshape(-1, 1),
                            (segment_pos.shape[0], 1))
  starts = jnp.where(segment_pos == 0, jnp.broadcast_to(index, segment_pos.shape), before)
  return jax.lax.cummax(starts.astype(jnp.int32), axis=1)


def delayed(x: jax.Array, shift: int, axes: P.Axes, history: Optional[jax.Array] = None,
            fill: Any = 0) -> jax.Array:
  """x delayed by `shift` steps along time (axis 1): out[:, t] = x[:, t - shift].

  Steps before the first come from `history` (the inputs just before x, [B, H, ...] with
  H ≥ shift) or, without one, are `fill`.

  When the mesh in scope splits time (`axes`, the logical names of x's dimensions, map
  axis 1 to a mesh axis) and each shard holds at least `shift` steps, each shard sends its
  last `shift` steps to its right neighbour with one `ppermute` (a halo exchange; its
  transpose in the backward pass is the same exchange leftwards). XLA's partitioner would
  also accept the pad-and-slice below on a split array, but it may move most of a shard
  per shift in the backward pass instead of the halo.
  """
  if shift == 0:
    return x
  length = x.shape[1]
  if history is not None:
    extended = jnp.concatenate([history, x], axis=1)
    start = history.shape[1] - shift
    return extended[:, start:start + length]
  layout = P.sequence_sharding(length, axes)
  if layout is None or length // layout.shards < shift:
    pad = [(0, 0)] * x.ndim
    pad[1] = (shift, 0)
    return jnp.pad(x, pad, constant_values=fill)[:, :length]

  def local(x):
    halo = jax.lax.ppermute(x[:, -shift:], layout.axis,
                            [(i, i + 1) for i in range(layout.shards - 1)])
    first = jax.lax.axis_index(layout.axis) == 0
    halo = jnp.where(first, jnp.asarray(fill, x.dtype), halo)
    return jnp.concatenate([halo, x[:, :-shift]], axis=1)

  return jax.shard_map(local, mesh=layout.mesh, in_specs=layout.spec,
                       out_specs=layout.spec)(x)
