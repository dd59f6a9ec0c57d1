"""Logical axis names for parameters and activations, and a dense layer that carries them.

Every parameter is declared with logical axis names (`sharding.axes`, which this module
passes on as `P.EMBED`, ...; docs/INTERNALS.md) so the sharding rules in `sharding/` can
map them to mesh axes; every key activation is constrained with logical names, which is
a no-op until a mesh and rules are in scope.

`sequence_sharding` tells a temporal layer whether the mesh in scope splits time, so the
layer can switch to a shard-local algorithm (the RG-LRU's scan over shards) instead of
letting the partitioner gather the whole sequence. `shard_layout` gives an activation's
layout as `shard_map` specs, for code the partitioner cannot split by itself (Pallas
kernels carry no partitioning rule).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

# The logical axis names, defined once in `sharding.axes` (the rules table names them
# too); layers read them as `P.EMBED`, `P.BATCH`, ... beside `P.Dense` and `P.constrain`.
from sharding.axes import (ACT_EMBED, ACT_HEADS, ACT_MLP, ACT_RNN, ACT_VOCAB, BATCH, CONV,  # pylint: disable=unused-import
                           EMBED, KV, LAYERS, LENGTH, MLP, NORM, Q_HEADS, RNN, RNN_HEAD_DIM,
                           RNN_HEADS, VOCAB)

Initializer = Callable[..., jax.Array]
Axes = Sequence[Optional[str]]
MeshAxes = Union[None, str, tuple[str, ...]]


def logical_param(module: nn.Module, name: str, init: Initializer, shape: Sequence[int],
                  axes: Axes) -> jax.Array:
  """Declares a float32 parameter whose dimensions carry the logical names `axes`."""
  if len(axes) != len(shape):
    raise ValueError(f"parameter {name!r}: {len(axes)} axis names for shape {tuple(shape)}")
  return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape),
                      jnp.float32)


def constrain(x: jax.Array, axes: Axes) -> jax.Array:
  """Constrains an activation's sharding by logical names (no-op without a mesh)."""
  return nn.with_logical_constraint(x, tuple(axes))


class Dense(nn.Module):
  """y = x · W (+ b) over the last axis of x, computed in `dtype`.

  Attributes:
    features: output width.
    kernel_axes: logical names of the [in, out] kernel; the bias takes the second.
    kernel_scale: variance scale of the fan-in normal init (variance scale / fan_in).
    use_bias: add a zero-initialised bias.
    dtype: compute dtype (parameters stay float32).
  """
  features: int
  kernel_axes: tuple[Optional[str], Optional[str]]
  kernel_scale: float = 1.0
  use_bias: bool = True
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    init = nn.initializers.variance_scaling(self.kernel_scale, "fan_in", "normal")
    kernel = logical_param(self, "kernel", init,
                           (x.shape[-1], self.features), self.kernel_axes)
    y = jnp.einsum("...i,io->...o", x.astype(self.dtype), kernel.astype(self.dtype))
    if self.use_bias:
      bias = logical_param(self, "bias", nn.initializers.zeros_init(), (self.features,),
                           self.kernel_axes[1:])
      y = y + bias.astype(self.dtype)
    return y


class SequenceSharding(NamedTuple):
  """How the mesh in scope lays out an activation whose axis 1 is `length`.

  Attributes:
    mesh: the abstract mesh set by `jax.sharding.set_mesh` (sharding.rules).
    axis: the one mesh axis (of size > 1) that splits `length`.
    spec: the activation's PartitionSpec over mesh axes, from the logical-axis rules.
  """
  mesh: jax.sharding.AbstractMesh
  axis: str
  spec: jax.sharding.PartitionSpec

  @property
  def shards(self) -> int:
    return self.mesh.shape[self.axis]


def sequence_sharding(length: int, axes: Axes) -> Optional[SequenceSharding]:
  """The time split of an activation with logical `axes` (axes[1] == LENGTH), if any.

  Read while tracing from the mesh and logical-axis rules in scope (both set by
  `sharding.rules.activation_sharding` and by the trainer). None when there is no mesh,
  when `length` is not split (no rule, or mesh axes of size 1), or when `length` tokens
  do not divide evenly over the shards (a decoding step of one token): the caller then
  runs its single-device algorithm and the partitioner moves data as it must.

  Raises:
    ValueError: `length` is split over more than one mesh axis of size > 1.
  """
  if len(axes) < 2 or axes[1] != LENGTH:
    raise ValueError(f"sequence_sharding: axes {tuple(axes)} must have {LENGTH!r} second")
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  spec = nn.logical_to_mesh_axes(tuple(axes))
  split = [name for name in mesh_axis_names(spec[1]) if mesh.shape[name] > 1]
  if not split:
    return None
  if len(split) > 1:
    raise ValueError(f"the logical axis {LENGTH!r} is split over mesh axes {split}; the "
                     "sequence-parallel layers support one mesh axis for time. Map "
                     f"{LENGTH!r} to a single mesh axis in logical_axis_rules.")
  if length % mesh.shape[split[0]]:
    return None
  return SequenceSharding(mesh, split[0], spec)


class ShardLayout(NamedTuple):
  """An activation's layout in the mesh in scope, as `shard_map` takes it.

  Attributes:
    mesh: the abstract mesh set by `jax.sharding.set_mesh`.
    spec: per dimension, the mesh axes the rules map it to, less those whose shards
      would not divide it (that dimension is then whole on every shard, e.g. the
      batch of one in a decoding step). Axes of size 1 stay named: an axis missing
      from a `shard_map` spec makes its transpose sum cotangents over that axis, which
      XLA keeps as a (trivial) all-reduce of the whole block.
  """
  mesh: jax.sharding.AbstractMesh
  spec: jax.sharding.PartitionSpec


def shard_layout(shape: Sequence[int], axes: Axes) -> Optional[ShardLayout]:
  """The layout of an activation of `shape` with logical `axes`; None off a mesh.

  Read while tracing from the mesh and logical-axis rules in scope, like
  `sequence_sharding`. None when there is no mesh or it has a single device: the
  caller then needs no `shard_map`.
  """
  if len(axes) != len(shape):
    raise ValueError(f"shard_layout: {len(axes)} axis names for shape {tuple(shape)}")
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return None
  entries = []
  for dim, entry in zip(shape, nn.logical_to_mesh_axes(tuple(axes))):
    kept, shards = [], 1
    for name in mesh_axis_names(entry):
      if dim % (shards * mesh.shape[name]):
        break
      kept.append(name)
      shards *= mesh.shape[name]
    entries.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return ShardLayout(mesh, jax.sharding.PartitionSpec(*entries))


def mesh_axis_names(entry: MeshAxes) -> tuple[str, ...]:
  """One PartitionSpec entry as a tuple of mesh axis names (empty = replicated)."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)
