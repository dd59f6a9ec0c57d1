"""TPU slices named like Cloud TPU types (`v5p-128`), as libtpu device descriptions.

libtpu describes the chips of any TPU topology without a TPU attached
(`jax.experimental.topologies.get_topology_desc`); `jit(...).lower(...).compile()` over a
mesh of those descriptions runs the real XLA:TPU and Mosaic compilers on the host, so a
CPU machine can check that a program compiles for a v5p-128 and how much HBM it needs.
The host's own JAX backend stays what it was (CPU in the tests): no TPU runtime starts.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from typing import Any

from jax.experimental import topologies

from plumbing.errors import UserError, usage_error
from sharding.tpu_slice import TpuSlice

INSTALL_HINT = ('libtpu is not installed, so TPU programs cannot be compiled here; '
                'install it with: pip install -e ".[tpu]"')
GIB = 2 ** 30
# HBM per chip (one JAX device: v4 and v5p chips are megacore, one device per chip).
HBM_BYTES = {"v4": 32 * GIB, "v5p": 95 * GIB, "v5e": 16 * GIB, "v6e": 32 * GIB}
# HBM bandwidth per chip, bytes per second (Cloud TPU's published figures), for the
# roofline time of kernels XLA's cost model cannot see into
# (`pretrain.compilation.kernel_estimates`).
HBM_BANDWIDTH = {"v4": 1.228e12, "v5p": 2.765e12, "v5e": 8.19e11, "v6e": 1.64e12}
_CHIP_CONFIG = {"v4": "megacore", "v5p": "megacore", "v5e": "default", "v6e": "default"}
# libtpu otherwise queries the GCE metadata server for the host it runs on, and takes a
# machine-wide lock meant for processes that drive TPU chips (compiling drives none).
# Without a worker id it also sets TPU_WORKER_ID (and CLOUD_TPU_TASK_ID) in the C
# environment to a warning sentence, which every later subprocess inherits: a sweep's
# `launch.sweep_job` then reads itself as a process other than 0 and records nothing.
_HOST_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost",
             "TPU_WORKER_ID": "0", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


@dataclasses.dataclass(frozen=True)
class TpuTarget:
  """A compile target: `num_slices` slices of a Cloud TPU type.

  Attributes:
    name: the slice type as given (`v5p-128`, `v5litepod-256`, `v6e-64`).
    generation: "v4", "v5p", "v5e" or "v6e".
    chips: chips per slice (one JAX device each).
    topology: the slice's torus, e.g. "4x4x4".
    chips_per_host: chips attached to one host VM.
    num_slices: slices joined over the data-centre network.
    hbm_bytes: HBM per chip.
  """
  name: str
  generation: str
  chips: int
  topology: str
  chips_per_host: int
  num_slices: int
  hbm_bytes: int

  @property
  def devices(self) -> int:
    return self.chips * self.num_slices


def parse_target(name: str, num_slices: int = 1) -> TpuTarget:
  """A TpuTarget from a slice type such as v5p-128, v4-32, v5e-16 / v5litepod-16, v6e-64.

  Raises:
    UserError (usage): an unknown name or a slice count below 1.
  """
  if num_slices < 1:
    raise usage_error(f"--num_slices must be >= 1, got {num_slices}")
  shape = TpuSlice(re.sub(r"^v5litepod-", "v5e-", name))
  return TpuTarget(name, shape.generation, shape.chips, shape.topology,
                   shape.chips_per_host, num_slices, HBM_BYTES[shape.generation])


def _host_bounds(target: TpuTarget) -> tuple[int, int, int]:
  """Chips of one host along each torus axis: the whole slice, or a 2x2 (2x4 for 8)."""
  if target.chips_per_host == target.chips:
    dims = [int(size) for size in target.topology.split("x")]
    return tuple(dims + [1] * (3 - len(dims)))
  return (2, 4, 1) if target.chips_per_host == 8 else (2, 2, 1)


def libtpu_available() -> bool:
  return importlib.util.find_spec("libtpu") is not None


def target_devices(target: TpuTarget) -> list[Any]:
  """Device descriptions of every chip of the target (all slices), for a compile-only mesh.

  Raises:
    UserError: libtpu is not installed (one line saying how to install it).
  """
  if not libtpu_available():
    raise UserError(INSTALL_HINT)
  for key, value in _HOST_ENV.items():
    os.environ.setdefault(key, value)
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", target.name)
  description = topologies.get_topology_desc(
      platform="tpu", topology_name=f"{target.generation}:{target.topology}",
      chip_config_name=_CHIP_CONFIG[target.generation],
      chips_per_host_bounds=_host_bounds(target), num_slices=target.num_slices)
  return list(description.devices)
