"""The shape of a Cloud TPU slice named like `v5p-128`: chips, hosts, topology and the
GKE labels that select it. The launchers (GKE, TPU VMs) place processes with it and the
ahead-of-time TPU compile (`pretrain.compilation.tpu_target`) builds its device topology from it."""
from __future__ import annotations

import re

from plumbing.errors import usage_error

# Per generation: GKE accelerator label, TensorCores per chip (the "-N" in v5p-128 counts
# cores on v4/v5p and chips on v5e/v6e), chips per multi-host VM, torus dimensions.
_TPU_GENERATIONS = {
    "v4": dict(gke_accelerator="tpu-v4-podslice", cores_per_chip=2, chips_per_host=4, dims=3),
    "v5p": dict(gke_accelerator="tpu-v5p-slice", cores_per_chip=2, chips_per_host=4, dims=3),
    "v5e": dict(gke_accelerator="tpu-v5-lite-podslice", cores_per_chip=1, chips_per_host=4,
                dims=2),
    "v6e": dict(gke_accelerator="tpu-v6e-slice", cores_per_chip=1, chips_per_host=4, dims=2),
}
# Default torus shapes by chip count (GKE's documented topologies).
_TOPOLOGIES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4",
                  128: "4x4x8", 256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16",
                  4096: "16x16x16"}
_TOPOLOGIES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8",
                  128: "8x16", 256: "16x16"}


class TpuSlice:
  """Shape of one TPU slice named like `v5p-128`: chips, hosts and GKE labels."""

  def __init__(self, tpu_type: str, topology: str | None = None):
    match = re.fullmatch(r"(v4|v5p|v5e|v6e)-(\d+)", tpu_type)
    if not match:
      raise usage_error(f"--tpu_type {tpu_type!r} must look like v5p-128, v4-32, v5e-256 "
                        f"or v6e-64 (generations {sorted(_TPU_GENERATIONS)})")
    self.name = tpu_type
    self.generation = match.group(1)
    spec = _TPU_GENERATIONS[self.generation]
    count = int(match.group(2))
    if count % spec["cores_per_chip"]:
      raise usage_error(f"--tpu_type {tpu_type}: {self.generation} counts TensorCores, "
                        f"{spec['cores_per_chip']} per chip; {count} is not a whole number "
                        "of chips")
    self.chips = count // spec["cores_per_chip"]
    table = _TOPOLOGIES_3D if spec["dims"] == 3 else _TOPOLOGIES_2D
    self.topology = topology or table.get(self.chips)
    if self.topology is None:
      raise usage_error(f"--tpu_type {tpu_type}: no default topology for {self.chips} "
                        "chips; pass --topology (e.g. 4x4x4)")
    if not re.fullmatch(r"\d+(x\d+)+", self.topology):
      raise usage_error(f"--topology {self.topology!r} must look like 4x4x4 or 16x16")
    topology_chips = 1
    for size in self.topology.split("x"):
      topology_chips *= int(size)
    if topology_chips != self.chips:
      raise usage_error(f"--topology {self.topology} has {topology_chips} chips but "
                        f"{tpu_type} has {self.chips}")
    single_host = self.chips <= (8 if spec["dims"] == 2 else spec["chips_per_host"])
    self.chips_per_host = self.chips if single_host else spec["chips_per_host"]
    self.hosts = self.chips // self.chips_per_host
    self.gke_accelerator = spec["gke_accelerator"]


