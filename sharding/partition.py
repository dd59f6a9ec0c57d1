"""Shardings for parameters, optimizer state and batches, and checks on them.

The model names every parameter dimension logically (`model.lm.param_logical_axes`);
`sharding.rules` maps names to mesh axes; this module turns those into
`NamedSharding`s for whole pytrees, and assembles per-process batch rows into global
arrays. Everything here works on shapes (`jax.ShapeDtypeStruct`), so the trainer can
create state directly in its sharded layout with `jax.jit(..., out_shardings=...)` and
the memory planner can lower programs without allocating.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np
import optax

from sharding import rules as rules_lib

PartitionSpec = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding


def _is_spec(x: Any) -> bool:
  return isinstance(x, PartitionSpec)


def path_str(path: Sequence[Any]) -> str:
  """'blocks/0/mlp/kernel' style name of a pytree path."""
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def _check_divisible(where: str, shape: Sequence[int], spec: PartitionSpec,
                     mesh: jax.sharding.Mesh) -> None:
  for dim, (size, entry) in enumerate(zip(shape, spec)):
    if entry is None:
      continue
    axes = (entry,) if isinstance(entry, str) else tuple(entry)
    shards = math.prod(mesh.shape[axis] for axis in axes)
    if size % shards:
      raise ValueError(
          f"{where}: dimension {dim} of shape {tuple(shape)} has size {size}, which the "
          f"mesh axes {axes} (together {shards} shards, mesh {dict(mesh.shape)}) do not "
          "divide. Pick model sizes divisible by the mesh, a smaller axis, or change "
          "logical_axis_rules for this dimension.")


def logical_to_shardings(mesh: jax.sharding.Mesh, logical_specs: Any,
                         shapes: Any = None,
                         rules: Optional[Sequence[tuple[str, rules_lib.MeshAxes]]] = None) -> Any:
  """NamedShardings for a pytree of logical PartitionSpecs.

  Args:
    mesh: the device mesh.
    logical_specs: pytree of PartitionSpecs of logical names (e.g.
      `model.lm.param_logical_axes(config)`).
    shapes: optional pytree of the same structure with `.shape` leaves (arrays or
      ShapeDtypeStructs); if given, every sharded dimension is checked to divide evenly
      and each spec's length to match its array's rank.
    rules: logical-axis table (default: `rules.DEFAULT_RULES`).

  Returns:
    A pytree of `NamedSharding` with the structure of `logical_specs`.
  """
  rules = rules_lib.DEFAULT_RULES if rules is None else rules

  def one(path, logical):
    where = path_str(path)
    return NamedSharding(mesh, rules_lib.logical_to_mesh_spec(logical, rules, where=where))

  shardings = jax.tree_util.tree_map_with_path(one, logical_specs, is_leaf=_is_spec)
  if shapes is not None:
    def check(path, sharding, leaf):
      where = path_str(path)
      if len(sharding.spec) != len(leaf.shape):
        raise ValueError(f"{where}: logical spec {sharding.spec} has {len(sharding.spec)} "
                         f"entries but the array has shape {tuple(leaf.shape)}")
      _check_divisible(where, leaf.shape, sharding.spec, mesh)
    jax.tree_util.tree_map_with_path(check, shardings, shapes)
  return shardings


# Parameters larger than this that the rules leave whole over `fsdp` get it added
# (`param_shardings`).
FSDP_FALLBACK_BYTES = 2 ** 20


def _axis_names(entry: Any) -> tuple[str, ...]:
  return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def with_fsdp_fallback(spec: PartitionSpec, logical: PartitionSpec, shape: Sequence[int],
                       nbytes: int, mesh_shape: Mapping[str, int],
                       min_bytes: int = FSDP_FALLBACK_BYTES) -> PartitionSpec:
  """`spec`, with `fsdp` added to one dimension if the array is large and fsdp splits none.

  The rules shard matrices over fsdp through `embed` or the RG-LRU's `rnn_head_dim`,
  but a per-layer vector stacked over depth (MLP biases [L, M], Conv1D kernels [L, W, R],
  the RG-LRU's a_param [L, R]) names only tensor-parallel axes: at 14B such leaves are
  1-5 MiB each, whole on every fsdp shard. Here fsdp joins the dimension with the most
  elements per shard that it still divides, never the stacked `layers` axis (the depth
  scan slices it every iteration). `mesh_shape` maps mesh axis names to sizes.
  """
  fsdp = mesh_shape.get("fsdp", 1)
  if fsdp == 1 or nbytes <= min_bytes or any("fsdp" in _axis_names(e) for e in spec):
    return spec
  entries = list(spec) + [None] * (len(shape) - len(spec))
  best, best_size = None, 0
  for dim, (size, entry) in enumerate(zip(shape, entries)):
    if dim < len(logical) and "layers" in _axis_names(logical[dim]):
      continue
    shards = math.prod(mesh_shape[axis] for axis in _axis_names(entry))
    if size % (shards * fsdp) == 0 and size // shards > best_size:
      best, best_size = dim, size // shards
  if best is None:
    return spec
  axes = _axis_names(entries[best]) + ("fsdp",)
  entries[best] = axes[0] if len(axes) == 1 else axes
  return PartitionSpec(*entries)


def param_shardings(mesh: jax.sharding.Mesh, logical_specs: Any, param_shapes: Any = None,
                    rules: Optional[Sequence[tuple[str, rules_lib.MeshAxes]]] = None) -> Any:
  """Shardings of the parameter pytree (see `logical_to_shardings`).

  With `param_shapes`, a parameter over FSDP_FALLBACK_BYTES that the rules leave whole
  over `fsdp` is split over it too (`with_fsdp_fallback`), so FSDP shards everything
  large, as its name promises.
  """
  shardings = logical_to_shardings(mesh, logical_specs, param_shapes, rules)
  if param_shapes is None:
    return shardings

  def fallback(sharding, logical, leaf):
    nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    return NamedSharding(mesh, with_fsdp_fallback(sharding.spec, logical, leaf.shape,
                                                  nbytes, dict(mesh.shape)))

  return jax.tree_util.tree_map(fallback, shardings, logical_specs, param_shapes)


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def opt_state_shardings(optimizer: optax.GradientTransformation, opt_state_shapes: Any,
                        param_shardings_tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """Shardings for an optax state: every copy of the parameter tree inside it (Adam's
  moments, EMA, ...) is sharded like the parameters; everything else (step counts,
  scalars of schedules) is replicated.

  Args:
    optimizer: the optax transformation whose `init` made the state; optax uses it to
      find which parts of the state mirror the parameters (also inside `optax.masked`).
    opt_state_shapes: the state or its shapes, e.g. `jax.eval_shape(optimizer.init, params)`.
    param_shardings_tree: the parameters' shardings (`param_shardings`).
    mesh: the device mesh.
  """
  return optax.tree_utils.tree_map_params(
      optimizer,
      lambda _, sharding: sharding,
      opt_state_shapes,
      param_shardings_tree,
      transform_non_params=lambda _: replicated(mesh),
      is_leaf=lambda x: isinstance(x, optax.MaskedNode))


def batch_spec(rank: int = 2,
               rules: Optional[Sequence[tuple[str, rules_lib.MeshAxes]]] = None) -> PartitionSpec:
  """Spec of a `[rows, T, ...]` batch array: rows over `batch`, time over `length`."""
  logical = ("batch", "length") + (None,) * (rank - 2) if rank >= 2 else ("batch",)
  return rules_lib.logical_to_mesh_spec(PartitionSpec(*logical), rules, where="batch")


def batch_sharding(mesh: jax.sharding.Mesh, rank: int = 2,
                   rules: Optional[Sequence[tuple[str, rules_lib.MeshAxes]]] = None) -> NamedSharding:
  return NamedSharding(mesh, batch_spec(rank, rules))


def process_batch_rows(mesh: jax.sharding.Mesh, global_batch_size: int,
                       rules: Optional[Sequence[tuple[str, rules_lib.MeshAxes]]] = None,
                       process_index: Optional[int] = None) -> slice:
  """The rows of the global batch that `process_index` (default: this process) feeds.

  The input pipeline reads exactly these rows, so a run gives the same global batch
  whatever the number of processes. Raises if the rows a process owns are not one
  contiguous block (a mesh whose batch axes interleave processes).
  """
  sharding = batch_sharding(mesh, 1, rules)
  _check_divisible("global batch", (global_batch_size,), sharding.spec, mesh)
  process_index = jax.process_index() if process_index is None else process_index
  index_map = sharding.devices_indices_map((global_batch_size,))
  rows = sorted({(index[0].start or 0, index[0].stop or global_batch_size)
                 for device, index in index_map.items()
                 if device.process_index == process_index})
  if not rows:
    raise ValueError(f"Process {process_index} owns no device of the mesh")
  start, stop = rows[0][0], rows[-1][1]
  covered = sum(b - a for a, b in rows)
  if covered != stop - start or any(b != c for (_, b), (c, _) in zip(rows, rows[1:])):
    raise ValueError(
        f"Process {process_index}'s batch rows {rows} are not contiguous; order the mesh "
        "so the batch axes (replica, data, fsdp) are outer to the devices of one process")
  return slice(start, stop)


def make_global_batch(mesh: jax.sharding.Mesh, local_batch: Mapping[str, np.ndarray],
                      rules: Optional[Sequence[tuple[str, rules_lib.MeshAxes]]] = None
                      ) -> dict[str, jax.Array]:
  """Global, batch-sharded arrays from this process's rows (`process_batch_rows`).

  Each process passes only its own rows; no process ever holds the global batch.
  """
  out = {}
  for name, rows in local_batch.items():
    rows = np.asarray(rows)
    out[name] = jax.make_array_from_process_local_data(
        batch_sharding(mesh, rows.ndim, rules), rows)
  return out


def _is_replicated(spec: PartitionSpec, mesh: jax.sharding.Mesh) -> bool:
  """True if no mesh axis of size > 1 splits any dimension (every device holds it all)."""
  for entry in spec:
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    if any(mesh.shape[axis] > 1 for axis in axes):
      return False
  return True


@dataclasses.dataclass(frozen=True)
class ReplicationCheck:
  """How the start-up check treats large parameters that every device holds whole.

  Attributes:
    max_replicated_bytes: parameters up to this size may be replicated (norm scales,
      biases, the single MQA key/value head of small models, ...).
    action: "raise" (stop before training), "warn" (log a warning) or "ignore".
  """
  max_replicated_bytes: int = 64 * 2**20
  action: str = "raise"

  def __post_init__(self):
    if self.action not in ("raise", "warn", "ignore"):
      raise ValueError(f"ReplicationCheck.action must be raise, warn or ignore, got "
                       f"{self.action!r}")


def check_no_large_replicated(shapes: Any, shardings: Any, mesh: jax.sharding.Mesh,
                              max_replicated_bytes: int = 64 * 2**20,
                              action: str = "raise") -> list[str]:
  """Finds large parameters that every device holds whole although the mesh shards models.

  On a mesh with `fsdp` or `tensor` > 1, a big parameter that no mesh axis of size > 1
  splits is almost always a missing logical name, a rule typo, or a rule whose axis this
  mesh does not have (e.g. a tensor-only rule on an fsdp-only mesh); it wastes memory
  on every chip, so the trainer calls this at start-up.

  Args:
    shapes: pytree of arrays / ShapeDtypeStructs.
    shardings: matching pytree of NamedShardings.
    mesh: the device mesh.
    max_replicated_bytes: parameters up to this size may be replicated (norm scales,
      biases, the single MQA key/value head of small models, ...).
    action: "raise" (ValueError), "warn" (log a warning) or "ignore".

  Returns:
    Descriptions of the offending parameters (empty if none).
  """
  if action not in ("raise", "warn", "ignore"):
    raise ValueError(f"ReplicationCheck.action must be raise, warn or ignore, "
                     f"got {action!r}")
  if mesh.shape.get("fsdp", 1) * mesh.shape.get("tensor", 1) == 1 or action == "ignore":
    return []
  offenders = []

  def visit(path, leaf, sharding):
    nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    if nbytes > max_replicated_bytes and _is_replicated(sharding.spec, mesh):
      offenders.append(f"{path_str(path)} shape={tuple(leaf.shape)} spec={sharding.spec} "
                       f"({nbytes / 2**20:.1f} MiB)")

  jax.tree_util.tree_map_with_path(visit, shapes, shardings)
  if offenders:
    message = (
        f"{len(offenders)} parameter(s) larger than {max_replicated_bytes} bytes are "
        f"replicated on every device of mesh {dict(mesh.shape)}: " + "; ".join(offenders) +
        ". Give them logical axis names whose rules use this mesh's fsdp/tensor axes "
        "(logical_axis_rules.overrides), or raise "
        "ReplicationCheck.max_replicated_bytes / set ReplicationCheck.action='warn'.")
    if action == "raise":
      raise ValueError(message)
    logging.warning(message)
  return offenders


def _format_spec(spec: PartitionSpec) -> str:
  def entry(e):
    if e is None:
      return "-"
    return e if isinstance(e, str) else "+".join(e)
  return "(" + ", ".join(entry(e) for e in spec) + ")"


def format_sharding_table(params: Any, shardings: Any) -> str:
  """A text table of every parameter: path, global shape, mesh spec, per-device shape and
  bytes per device, with totals. For `--print_sharding`.

  Args:
    params: pytree of arrays or ShapeDtypeStructs.
    shardings: matching pytree of NamedShardings.
  """
  rows = []
  totals = [0, 0]

  def visit(path, leaf, sharding):
    shape = tuple(leaf.shape)
    local = tuple(sharding.shard_shape(shape))
    itemsize = np.dtype(leaf.dtype).itemsize
    totals[0] += math.prod(shape)
    totals[1] += math.prod(local) * itemsize
    rows.append((path_str(path), "x".join(map(str, shape)) or "scalar",
                 _format_spec(sharding.spec), "x".join(map(str, local)) or "scalar",
                 f"{math.prod(local) * itemsize:,}"))

  jax.tree_util.tree_map_with_path(visit, params, shardings)
  header = ("parameter", "shape", "spec", "per-device shape", "bytes/device")
  rows.append(("TOTAL", f"{totals[0]:,} params", "", "", f"{totals[1]:,}"))
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]

  def line(r):
    return "  ".join(c.ljust(w) if i < 4 else c.rjust(w)
                     for i, (c, w) in enumerate(zip(r, widths)))
  mesh = next(iter(jax.tree_util.tree_leaves(shardings)), None)
  title = f"Parameter sharding over mesh {dict(mesh.mesh.shape)}" if mesh is not None else ""
  rule = "-" * len(line(header))
  return "\n".join([title, line(header), rule] + [line(r) for r in rows[:-1]] +
                   [rule, line(rows[-1])])
