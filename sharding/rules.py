"""Logical axis names -> mesh axes: the one table that decides every layout.

Parameters and key activations name their dimensions logically (`embed`, `mlp`,
`batch`, ...; the names are `sharding.axes`, docs/INTERNALS.md). This table maps each name to the mesh axes
(sharding/mesh.py) its dimension is split over, or to None for replication, so a run
changes its parallelism plan in Gin without touching model code:

  logical_axis_rules.overrides = {"embed": None}        # no FSDP on parameters
  logical_axis_rules.overrides = {"mlp": ("fsdp", "tensor")}

Unlike Flax's first-match rule lists, every logical name has exactly one entry and an
unknown name is an error: a misspelt axis would otherwise silently replicate a tensor.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Mapping, Optional, Sequence, Union

import flax.linen as nn
import jax

from sharding import axes as A
from sharding.mesh import MESH_AXES

MeshAxes = Optional[Union[str, tuple[str, ...]]]
Rules = tuple[tuple[str, MeshAxes], ...]

BATCH_AXES = ("replica", "data", "fsdp")

DEFAULT_RULES: Rules = (
    # Parameters (docs/sharding.md#logical-axis-rules).
    (A.VOCAB, "tensor"),
    (A.EMBED, "fsdp"),
    (A.MLP, "tensor"),
    (A.RNN, "tensor"),
    (A.RNN_HEADS, "tensor"),      # block-diagonal RG-LRU gates: whole blocks per shard
    (A.RNN_HEAD_DIM, None),       # FSDP added where it divides (partition.param_shardings)
    (A.Q_HEADS, "tensor"),
    (A.KV, None),                 # the single MQA key/value head, replicated
    (A.CONV, None),
    (A.LAYERS, None),
    (A.NORM, None),
    # Activations.
    (A.BATCH, BATCH_AXES),
    (A.LENGTH, "sequence"),
    (A.ACT_EMBED, None),
    (A.ACT_MLP, "tensor"),
    (A.ACT_RNN, "tensor"),
    (A.ACT_HEADS, "tensor"),
    (A.ACT_VOCAB, "tensor"),
)


def _normalise(logical: str, axes: MeshAxes) -> tuple[str, ...]:
  if axes is None:
    return ()
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  for axis in axes:
    if axis not in MESH_AXES:
      raise ValueError(f"Sharding rule for logical axis {logical!r} names mesh axis "
                       f"{axis!r}; mesh axes are {MESH_AXES}")
  return axes


def logical_axis_rules(rules: Sequence[tuple[str, MeshAxes]] = DEFAULT_RULES,
                       overrides: Optional[Mapping[str, MeshAxes]] = None) -> Rules:
  """The (logical name, mesh axes) table in force, `overrides` applied on top of `rules`.

  Args:
    rules: the full table; each logical name once.
    overrides: entries replacing (or adding to) `rules`, for one-line Gin changes.

  Returns:
    A tuple of (logical name, mesh axis | tuple of mesh axes | None) pairs.
  """
  table: dict[str, MeshAxes] = {}
  for logical, axes in rules:
    if logical in table:
      raise ValueError(f"logical_axis_rules names {logical!r} twice; give each logical "
                       "axis one entry (use `overrides` to change one)")
    _normalise(logical, axes)
    table[logical] = axes
  for logical, axes in (overrides or {}).items():
    _normalise(logical, axes)
    table[logical] = axes
  return tuple(table.items())


def rules_dict(rules: Optional[Sequence[tuple[str, MeshAxes]]] = None) -> dict[str, tuple[str, ...]]:
  """The table as {logical: tuple of mesh axes} (empty tuple = replicated)."""
  rules = DEFAULT_RULES if rules is None else rules
  return {logical: _normalise(logical, axes) for logical, axes in rules}


def logical_to_mesh_spec(logical_spec: jax.sharding.PartitionSpec,
                         rules: Optional[Sequence[tuple[str, MeshAxes]]] = None,
                         *, where: str = "") -> jax.sharding.PartitionSpec:
  """Maps a PartitionSpec of logical names to one of mesh axes.

  Args:
    logical_spec: one entry per dimension: a logical name, a tuple of them, or None.
    rules: the table (default: DEFAULT_RULES).
    where: what the spec belongs to (a parameter path), for error messages.

  Raises:
    ValueError: a logical name has no rule, or two dimensions would use the same mesh
      axis (a mesh axis can split only one dimension of an array).
  """
  table = rules_dict(rules)
  context = f" of {where}" if where else ""
  used: dict[str, str] = {}
  entries = []
  for entry in logical_spec:
    names = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    axes: list[str] = []
    for name in names:
      if name not in table:
        raise ValueError(f"Logical axis {name!r}{context} has no sharding rule; add it to "
                         f"logical_axis_rules (known: {sorted(table)})")
      for axis in table[name]:
        if axis in used:
          raise ValueError(
              f"Mesh axis {axis!r} would shard both {used[axis]!r} and {name!r}{context} "
              f"(logical spec {logical_spec}); change logical_axis_rules so each mesh "
              "axis appears once per array")
        used[axis] = name
        axes.append(axis)
    entries.append(None if not axes else (axes[0] if len(axes) == 1 else tuple(axes)))
  return jax.sharding.PartitionSpec(*entries)


@contextlib.contextmanager
def activation_sharding(mesh: jax.sharding.Mesh,
                        rules: Optional[Sequence[tuple[str, MeshAxes]]] = None) -> Iterator[None]:
  """Scope in which the model's logical activation constraints take effect.

  The model constrains key activations by logical name (`nn.with_logical_constraint`),
  which is a no-op unless a mesh and the rules are in scope while it is traced. Trace
  (jit, lower, eval_shape) the model's apply inside this context.
  """
  rules = DEFAULT_RULES if rules is None else tuple(rules)
  with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield
