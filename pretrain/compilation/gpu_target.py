"""GPU clusters named like `h100-32`, as XLA:GPU device descriptions built on a CPU host.

JAX's CUDA plugin describes any number of GPUs of a kind without one attached
(`jax.experimental.topologies.get_topology_desc(platform="cuda", ...)`) from a
`stream_executor.GpuTargetConfigProto`: the device facts XLA:GPU, Triton and ptxas
compile for (compute capability, SM count, shared memory, registers, bandwidth, device
memory). `jit(...).lower(...).compile()` over a mesh of those descriptions runs the real
GPU compilers here, so a CPU machine can check that a program builds for 32 H100s and
how much memory each needs. The specs are data in `pretrain/compilation/gpu_specs/<kind>.txtpb`,
written for this project from the vendors' published facts; the device memory the
report compares against is read from the same file, so there is one source of truth.
The host's own JAX backend stays what it was (CPU): no GPU client starts.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
from typing import Any

from jax.experimental import topologies

from plumbing.errors import UserError, usage_error

INSTALL_HINT = ('the CUDA plugin is not installed, so GPU programs cannot be compiled '
                'here; install it with: pip install -e ".[gpu-aot]"')
SPEC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs")
KINDS = ("a100", "h100", "h200", "b200")
DEFAULT_GPUS_PER_NODE = 8


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """A compile target: `nodes` hosts of `gpus_per_node` GPUs of one kind.

  Attributes:
    name: as given (`h100-32`).
    kind: "a100", "h100", "h200" or "b200" (the spec file's name).
    gpus: GPUs in all (one JAX device each).
    gpus_per_node: GPUs attached to one host (one process each under SLURM).
    hbm_bytes: device memory per GPU, from the spec.
    num_slices: always 1 (a GPU cluster is one NVLink/InfiniBand slice here).
  """
  name: str
  kind: str
  gpus: int
  gpus_per_node: int
  hbm_bytes: int
  num_slices: int = 1

  @property
  def devices(self) -> int:
    return self.gpus

  @property
  def nodes(self) -> int:
    return self.gpus // self.gpus_per_node


def is_gpu_name(name: str) -> bool:
  """Whether `--topology` is to be read as GPUs (`h100-32`): every Cloud TPU type
  starts with "v" (`v5p-128`, `v5litepod-16`), so anything else is checked as GPUs
  and a typo gets the GPU parser's error, which names both forms."""
  return not name.startswith("v")


def spec_path(kind: str) -> str:
  return os.path.join(SPEC_DIR, f"{kind}.txtpb")


@functools.lru_cache(maxsize=None)
def spec_text(kind: str) -> str:
  with open(spec_path(kind), encoding="utf-8") as f:
    return f.read()


def spec_field(kind: str, field: str) -> str:
  """One scalar field of a spec (`device_memory_size`), as written."""
  match = re.search(rf'^\s*{field}:\s*(?:"([^"]*)"|(\S+))', spec_text(kind), re.MULTILINE)
  if match is None:
    raise ValueError(f"{spec_path(kind)} has no {field}")
  return match.group(1) if match.group(1) is not None else match.group(2)


def parse_target(name: str, gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> GpuTarget:
  """A GpuTarget from `<kind>-<GPUs>`: h100-8, h100-32, h200-16, a100-64, b200-8.

  Raises:
    UserError (usage): an unknown kind, or a GPU count that is not whole nodes.
  """
  match = re.fullmatch(r"([a-z]\d+)-(\d+)", name)
  if match is None or match.group(1) not in KINDS:
    raise usage_error(f"--topology {name!r} is not a known target: TPU slices look like "
                      f"v5p-128, GPUs like h100-32 (kinds {', '.join(KINDS)})")
  gpus = int(match.group(2))
  if gpus_per_node < 1 or gpus < 1 or (gpus > gpus_per_node and gpus % gpus_per_node):
    raise usage_error(f"--topology {name}: {gpus} GPUs are not whole nodes of "
                      f"--gpus_per_node={gpus_per_node}")
  kind = match.group(1)
  return GpuTarget(name, kind, gpus, min(gpus, gpus_per_node),
                   int(spec_field(kind, "device_memory_size")))


def plugin_available() -> bool:
  """Whether JAX's CUDA plugin (XLA:GPU) is installed."""
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:  # no jax_plugins package at all
    return False


def target_devices(target: GpuTarget) -> list[Any]:
  """Device descriptions of every GPU of the target, for a compile-only mesh.

  Raises:
    UserError: the CUDA plugin is not installed (one line saying how to install it).
  """
  if not plugin_available():
    raise UserError(INSTALL_HINT)
  description = topologies.get_topology_desc(
      platform="cuda", topology_name=target.kind, target_config=spec_text(target.kind),
      topology=f"1x{target.nodes}x{target.gpus_per_node}")
  return list(description.devices)
