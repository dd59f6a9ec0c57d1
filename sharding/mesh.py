"""Device meshes built from a Gin-configured shape.

Every mesh has the same five named axes, outermost first:

  replica   data-parallel copies across slices / DCN (multi-slice); the slow network
  data      plain data parallelism inside a slice
  fsdp      data parallelism with parameters and optimizer state sharded (ZeRO-3)
  sequence  the time axis of activations (sequence-sharded scan)
  tensor    Megatron-style model parallelism; innermost, so it gets the fastest links

Axes a run does not use have size 1, so the logical-axis rules can always name all of
them and a spec that mentions an unused axis costs nothing. One size may be -1: it is
filled with whatever the device count leaves over, so `data=-1` means "all the rest".
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils

MESH_AXES = ("replica", "data", "fsdp", "sequence", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the mesh axes; their product must equal the number of devices.

  Attributes:
    replica: slices joined over DCN (multi-slice TPU, or GPU nodes used as pure data
      replicas); >1 builds a hybrid mesh whose outer axis crosses slices.
    data: data-parallel size within a slice.
    fsdp: fully-sharded data-parallel size (parameters/optimizer state sharded).
    sequence: shards of the time axis.
    tensor: model-parallel size (heads, MLP and RNN channels, vocab).
  """
  replica: int = 1
  data: int = -1
  fsdp: int = 1
  sequence: int = 1
  tensor: int = 1

  def __post_init__(self):
    sizes = self.as_dict()
    for name, size in sizes.items():
      if not isinstance(size, int) or (size < 1 and size != -1):
        raise ValueError(f"MeshConfig.{name} must be a positive integer or -1 (fill from "
                         f"the device count), got {size!r}")
    wildcards = [name for name, size in sizes.items() if size == -1]
    if len(wildcards) > 1:
      raise ValueError(f"MeshConfig: at most one axis may be -1, got {wildcards}; give "
                       "explicit sizes to all but one")

  def as_dict(self) -> dict[str, int]:
    return {name: getattr(self, name) for name in MESH_AXES}

  def resolved_shape(self, num_devices: int) -> dict[str, int]:
    """Axis sizes with the -1 axis filled so the product equals `num_devices`."""
    sizes = self.as_dict()
    known = math.prod(size for size in sizes.values() if size != -1)
    wildcard = next((name for name, size in sizes.items() if size == -1), None)
    described = ", ".join(f"{name}={size}" for name, size in sizes.items())
    if wildcard is not None:
      if num_devices % known:
        raise ValueError(
            f"Mesh ({described}): the fixed axes multiply to {known}, which does not "
            f"divide the {num_devices} devices, so {wildcard}=-1 cannot be filled. Choose "
            f"sizes whose product divides {num_devices}.")
      sizes[wildcard] = num_devices // known
    elif known != num_devices:
      raise ValueError(
          f"Mesh ({described}) has {known} positions but there are {num_devices} "
          f"devices. Make the product of the axis sizes equal {num_devices}, or set one "
          "axis to -1 to fill it from the device count.")
    return sizes


def parse_mesh_flag(flag: str) -> dict[str, int]:
  """Parses `"data:2,fsdp:4,tensor:1"` into `{"data": 2, "fsdp": 4, "tensor": 1}`.

  Axes left out are not in the result (MeshConfig's defaults apply to them).
  """
  sizes: dict[str, int] = {}
  for item in filter(None, (part.strip() for part in flag.split(","))):
    name, sep, value = item.partition(":")
    name = name.strip()
    if not sep or name not in MESH_AXES:
      raise ValueError(f"--mesh item {item!r} must be AXIS:SIZE with AXIS one of "
                       f"{MESH_AXES}, e.g. 'data:2,fsdp:4,tensor:1'")
    if name in sizes:
      raise ValueError(f"--mesh names axis {name!r} twice in {flag!r}")
    try:
      sizes[name] = int(value)
    except ValueError:
      raise ValueError(f"--mesh size of {name!r} must be an integer (or -1), got "
                       f"{value!r}") from None
  if not sizes:
    raise ValueError(f"--mesh {flag!r} names no axis; expected e.g. 'data:2,fsdp:4,tensor:1'")
  return sizes


def mesh_config_from_flag(flag: str) -> MeshConfig:
  """A MeshConfig from a `--mesh` flag; unnamed axes have size 1 (data -1 only if named)."""
  sizes = {name: 1 for name in MESH_AXES}
  sizes.update(parse_mesh_flag(flag))
  return MeshConfig(**sizes)


def _slice_index(device: Any) -> Optional[int]:
  return getattr(device, "slice_index", None)


def create_mesh(config: MeshConfig, devices: Optional[Sequence[Any]] = None) -> jax.sharding.Mesh:
  """Builds the device mesh of `config` over `devices` (default: all global devices).

  On TPU and GPU the in-slice axes follow the physical topology (`mesh_utils`), and
  `replica > 1` builds a hybrid mesh whose replica axis crosses the slow network (TPU
  slices, or processes where devices carry no slice index). On CPU (tests, simulated
  hosts) the devices, ordered by process, are reshaped directly, so the outer axes
  cross processes just as they would cross hosts.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = config.resolved_shape(len(devices))
  shape = tuple(sizes[name] for name in MESH_AXES)
  platform = devices[0].platform
  if platform == "cpu":
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    device_array = np.array(ordered, dtype=object).reshape(shape)
  elif sizes["replica"] > 1:
    ici_shape = (1,) + shape[1:]
    dcn_shape = (sizes["replica"],) + (1,) * (len(shape) - 1)
    device_array = mesh_utils.create_hybrid_device_mesh(
        ici_shape, dcn_shape, devices,
        process_is_granule=_slice_index(devices[0]) is None,
        allow_split_physical_axes=True)
  else:
    device_array = mesh_utils.create_device_mesh(shape, devices,
                                                 allow_split_physical_axes=True)
  return jax.sharding.Mesh(device_array, MESH_AXES)


def mesh_shape(mesh: jax.sharding.Mesh) -> dict[str, int]:
  """Axis sizes of `mesh` as a plain dict in mesh order."""
  return dict(mesh.shape)
