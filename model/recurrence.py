"""The recurrence as every recurrent layer calls it: the engine, split over shards on demand.

RG-LRU, CG-LRU and GateLoop share this entry point so that a mesh parallelises all of
them the same way, in training and in decoding, without any layer knowing about meshes.
"""
from __future__ import annotations

from typing import Optional

import jax

from model import partitioning as P
from model import scan

_LAYOUT = (P.BATCH, P.LENGTH, P.ACT_RNN)


def mesh_aware_linear_scan(a: jax.Array, x: jax.Array, h0: Optional[jax.Array], *,
                           impl: str, options: scan.ScanOptions
                           ) -> tuple[jax.Array, jax.Array]:
  """h_t = a_t h_{t-1} + x_t over [B, T, C]; inside `shard_map` where a mesh needs it.

  For any recurrent layer whose [B, T, C] inputs are laid out as (BATCH, LENGTH,
  ACT_RNN). `impl` and `options` are the model's (`ModelConfig.scan_impl`,
  `ModelConfig.scan`), as in `model.scan.linear_scan`.

  Under a mesh of several devices the scan runs in `shard_map` over the activation's
  own layout (so nothing is resharded on the way in or out) when
  - the mesh's `sequence` axis splits T (sharding.rules maps `length` to it): each shard
    scans its own slice and only the [shards, B, C] carries cross devices; or
  - the scan is a Pallas kernel: Mosaic (TPU) and Triton (GPU) custom calls carry no
    partitioning rule, so under plain `jit` Mosaic refuses to compile and a GPU kernel
    would get every device's rows gathered. Each device scans its batch and channel
    block.
  Otherwise (one device, or an XLA scan with time unsplit, including a decoding step
  whose few tokens do not divide over the shards) the plain engine runs and the
  partitioner splits it.
  """
  time_split = P.sequence_sharding(x.shape[1], _LAYOUT)
  pallas = scan.resolve_impl(impl, options)[0] == "pallas"
  layout = P.shard_layout(x.shape, _LAYOUT) if (time_split or pallas) else None
  if layout is None:
    return scan.linear_scan(a, x, h0, options=options, impl=impl)
  return scan.shard_mapped_linear_scan(a, x, h0, mesh=layout.mesh, spec=layout.spec,
                                       options=options, impl=impl)
