"""The linear scan inside `shard_map`: time split over a mesh axis ("sequence"), or not.

`shard_mapped_linear_scan` runs the scan on each device's own block of a [B, T, D]
activation laid out over the mesh. Pallas kernels need it: the partitioner cannot split
a Mosaic (TPU) or Triton (GPU) custom call, so under plain `jit` over several devices
Mosaic refuses to compile and a GPU kernel would see every device's operands gathered.
Batch and channels are independent, so their shards scan alone. Time is not:

a recurrence over a split sequence needs, on each shard, the state entering the
shard. Because the recurrence is linear, that state is affine in the previous
shard's: a shard maps h_in to P * h_in + L, where P is the product of the shard's
decays and L its final state from zero. So each shard

1. scans its slice from zero (any `impl`, including the Pallas kernel), giving
   h_local, L = h_local's last state, and the running decay product cumprod(a);
2. all-gathers only the tiny carries (P, L) of every shard, [shards, B, D], and
   folds them in scan order from h0 to get its own h_in (and the global last state);
3. corrects its states: h = h_local + cumprod(a) * h_in.

Nothing of size T crosses the interconnect; autodiff of the all-gather (a
reduce-scatter) carries the gradients of h_in back to the shards before.

Cost: one extra elementwise pass and a float32 cumprod(a) buffer per shard.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from model.scan import engine

AxisNames = Union[None, str, Sequence[str]]

_BATCH_AXES = ("replica", "data", "fsdp")
_CHANNEL_AXES = ("tensor",)


def shard_local_linear_scan(a: jax.Array, x: jax.Array, h0: Optional[jax.Array], *,
                            axis_name: str, options: engine.ScanOptions,
                            reverse: bool = False,
                            impl: str = "auto") -> tuple[jax.Array, jax.Array]:
  """`linear_scan` on this shard's slice of time, called inside `shard_map`.

  Args:
    a, x: this shard's [B, T/shards, D] slices, shards ordered by `axis_name` index.
    h0: the global initial state [B, D] (same on every shard of `axis_name`), or None.
    axis_name: the mesh axis that splits time.
    options: the local scan's options, as in `linear_scan`.
    reverse: as in `linear_scan`.
    impl: the local scan's implementation, as in `linear_scan`.

  Returns:
    (this shard's h [B, T/shards, D], the global last state [B, D], equal on all
    shards).
  """
  acc = engine.accumulation_dtype(a, x)
  h_local, local_last = engine.linear_scan(a, x, None, options=options, reverse=reverse,
                                           impl=impl)
  decay_so_far = jax.lax.cumprod(a.astype(acc), axis=1, reverse=reverse)
  shard_decay = decay_so_far[:, 0 if reverse else -1]
  # [shards, B, D] -> [B, shards, D]: one "time" step per shard.
  decays = jnp.moveaxis(_all_gather(shard_decay, axis_name), 0, 1)
  finals = jnp.moveaxis(_all_gather(local_last, axis_name), 0, 1)
  if h0 is None:
    h0 = jnp.zeros(local_last.shape, acc)
  ends, global_last = engine.associative_linear_scan(decays, finals, h0.astype(acc),
                                                     reverse, acc)
  # The state entering shard s is the state leaving its predecessor in scan order.
  before = (jnp.concatenate([ends[:, 1:], h0[:, None].astype(acc)], axis=1) if reverse
            else jnp.concatenate([h0[:, None].astype(acc), ends[:, :-1]], axis=1))
  h_in = jax.lax.dynamic_index_in_dim(before, jax.lax.axis_index(axis_name), axis=1,
                                      keepdims=False)
  h = h_local.astype(acc) + decay_so_far * h_in[:, None]
  return h.astype(h_local.dtype), global_last


def _all_gather(x: jax.Array, axis_name: str) -> jax.Array:
  """`all_gather`, complex values as real and imaginary planes: its transpose is a
  reduce-scatter, which XLA:TPU implements for real sums only (complex64 fails to
  compile, tests/test_tpu_compile.py)."""
  if not jnp.iscomplexobj(x):
    return jax.lax.all_gather(x, axis_name)
  return jax.lax.complex(jax.lax.all_gather(jnp.real(x), axis_name),
                         jax.lax.all_gather(jnp.imag(x), axis_name))


def _present(mesh: Mesh, wanted: AxisNames, defaults: tuple[str, ...]):
  """Mesh axes for a dimension: the given ones, or the defaults present in the mesh."""
  if wanted is None:
    found = tuple(name for name in defaults if mesh.shape.get(name, 1) > 1)
  else:
    found = (wanted,) if isinstance(wanted, str) else tuple(wanted)
  for name in found:
    if name not in mesh.shape:
      raise ValueError(f"sequence_sharded_linear_scan: mesh has no axis {name!r} "
                       f"(axes: {tuple(mesh.shape)}).")
  if not found:
    return None
  return found[0] if len(found) == 1 else found


def _size(mesh: Mesh, axes) -> int:
  if axes is None:
    return 1
  names = (axes,) if isinstance(axes, str) else axes
  size = 1
  for name in names:
    size *= mesh.shape[name]
  return size


def _names(entry) -> tuple[str, ...]:
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _single_axis(entry) -> Optional[str]:
  names = _names(entry)
  if len(names) > 1:
    raise ValueError(f"shard_mapped_linear_scan: time is split over mesh axes {names}; "
                     "the scan over shards supports one mesh axis for time.")
  return names[0] if names else None


def shard_mapped_linear_scan(a: jax.Array, x: jax.Array, h0: Optional[jax.Array] = None,
                             *, mesh: Union[Mesh, jax.sharding.AbstractMesh], spec: P,
                             options: engine.ScanOptions, reverse: bool = False,
                             impl: str = "auto") -> tuple[jax.Array, jax.Array]:
  """`linear_scan` on global [B, T, D] arrays, each device scanning its own block.

  Args:
    a, x, h0, options, reverse, impl: as in `model.scan.linear_scan`.
    mesh: the device mesh (concrete, or the abstract mesh in scope while tracing).
    spec: the activation's layout P(batch axes, time axis, channel axes); each entry's
      shards must divide its dimension. With a time axis the shards are chained by the
      scan over shards (module docstring); without one each shard's scan is the plain
      engine's. The state h0 / h_last is laid out P(batch axes, channel axes).

  Returns:
    (h [B, T, D], h_last [B, D]) exactly as `linear_scan` would give.
  """
  engine.validate(a, x, h0)
  if len(spec) != 3:
    raise ValueError(f"shard_mapped_linear_scan: spec {spec} must have 3 entries "
                     "(batch, time, channels).")
  for what, dim, axes in (("batch", x.shape[0], spec[0]), ("time", x.shape[1], spec[1]),
                          ("channels", x.shape[2], spec[2])):
    if dim % _size(mesh, axes):
      raise ValueError(f"shard_mapped_linear_scan: {what} size {dim} is not divisible by "
                       f"the {_size(mesh, axes)} shards of mesh axes {axes}; pad it or "
                       "change the mesh.")
  # A mesh axis of size 1 splits nothing (layouts keep it named, see
  # model.partitioning.ShardLayout): taken for a time split, it ran the scan over one
  # shard, a cumulative product of the decays (log T passes over HBM on TPU) and a
  # correction pass, forward and backward, that changed nothing.
  time_axis = _single_axis(tuple(name for name in _names(spec[1]) if mesh.shape[name] > 1))
  if time_axis is None:
    local = functools.partial(engine.linear_scan, options=options, reverse=reverse,
                              impl=impl)
  else:
    local = functools.partial(shard_local_linear_scan, axis_name=time_axis,
                              options=options, reverse=reverse, impl=impl)
  state_spec = P(spec[0], spec[2])
  # No replication check: Pallas calls carry no replication rule.
  if h0 is None:
    return jax.shard_map(lambda a, x: local(a, x, None), mesh=mesh, in_specs=(spec, spec),
                         out_specs=(spec, state_spec), check_vma=False)(a, x)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, state_spec),
                       out_specs=(spec, state_spec), check_vma=False)(a, x, h0)


def sequence_sharded_linear_scan(a: jax.Array, x: jax.Array,
                                 h0: Optional[jax.Array] = None, *, mesh: Mesh,
                                 options: engine.ScanOptions,
                                 axis_name: str = "sequence", reverse: bool = False,
                                 impl: str = "auto", batch_axes: AxisNames = None,
                                 channel_axes: AxisNames = None
                                 ) -> tuple[jax.Array, jax.Array]:
  """`linear_scan` on global arrays whose time axis is split over `axis_name`.

  Args:
    a, x, h0, options, reverse, impl: as in `model.scan.linear_scan`.
    mesh: the device mesh.
    axis_name: the mesh axis splitting time; T must be divisible by its size.
    batch_axes: mesh axes splitting the batch; None = those of ("replica", "data",
      "fsdp") in the mesh with size > 1 (the default logical-axis rules).
    channel_axes: mesh axes splitting channels; None = "tensor" if in the mesh.

  Returns:
    (h [B, T, D], h_last [B, D]) exactly as `linear_scan` would give.
  """
  if axis_name not in mesh.shape:
    raise ValueError(f"sequence_sharded_linear_scan: mesh has no axis {axis_name!r} "
                     f"(axes: {tuple(mesh.shape)}); pass axis_name=.")
  spec = P(_present(mesh, batch_axes, _BATCH_AXES), axis_name,
           _present(mesh, channel_axes, _CHANNEL_AXES))
  return shard_mapped_linear_scan(a, x, h0, mesh=mesh, spec=spec, options=options,
                                  reverse=reverse, impl=impl)
