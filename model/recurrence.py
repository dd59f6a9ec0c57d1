"""The recurrence as every recurrent layer calls it: the engine, split over shards on demand.

RG-LRU, CG-LRU and GateLoop share this entry point so that a mesh with a `sequence` axis
parallelises all of them the same way, without any layer knowing about meshes.
"""
from __future__ import annotations

from typing import Optional

import jax

from model import partitioning as P
from model import scan


def mesh_aware_linear_scan(a: jax.Array, x: jax.Array, h0: Optional[jax.Array], *,
                           impl: str, options: scan.ScanOptions
                           ) -> tuple[jax.Array, jax.Array]:
  """h_t = a_t h_{t-1} + x_t over [B, T, C]; split over shards when the mesh splits time.

  For any recurrent layer whose [B, T, C] inputs are laid out as (BATCH, LENGTH,
  ACT_RNN).

  Under a mesh whose `sequence` axis splits T (sharding.rules maps `length` to it), each
  shard scans its own slice and only the [shards, B, C] carries cross devices
  (`model.scan.sequence_sharded_linear_scan`); the shard_map specs are the activation's
  own layout, so nothing is resharded on the way in or out. Otherwise (one device, no
  time split, or a decoding call whose few tokens do not divide over the shards) the
  plain engine runs. `impl` and `options` are the model's (`ModelConfig.scan_impl`,
  `ModelConfig.scan`), as in `model.scan.linear_scan`.
  """
  layout = P.sequence_sharding(x.shape[1], (P.BATCH, P.LENGTH, P.ACT_RNN))
  if layout is None:
    return scan.linear_scan(a, x, h0, options=options, impl=impl)
  return scan.sequence_sharded_linear_scan(
      a, x, h0, mesh=layout.mesh, options=options, axis_name=layout.axis, impl=impl,
      batch_axes=P.mesh_axis_names(layout.spec[0]),
      channel_axes=P.mesh_axis_names(layout.spec[2]))
