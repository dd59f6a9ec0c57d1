"""`ScanOptions`, the machine-side tunables of the linear scans, and the platform a
scan's kernels are lowered for. Below both the dispatcher (`engine`) and the Pallas
kernels (`pallas_scan`), which each need them, so neither imports the other's module
for them."""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax

IMPLS = ("auto", "lax", "associative", "pallas")
# Platform names `ScanOptions.lowering_platform` accepts, and the kernel target of each.
PLATFORMS = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "cpu": "cpu"}
# NVIDIA compute capabilities whose compilers built the Pallas kernels in
# tests/test_gpu_compile.py, per Pallas GPU backend (module docstring, "auto").
VERIFIED_CUDA_CAPABILITIES = {"triton": ("8.0", "9.0", "10.0"),
                              "mosaic_gpu": ("9.0", "10.0")}


def _is_power_of_two(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class ScanOptions:
  """Tunables of the scan implementations (bind with Gin: `ScanOptions.lax_unroll = 16`).

  A property of the machine a program runs on, not of a trained model: models carry
  one in `ModelConfig.scan`, and checkpoints do not record it.

  Attributes:
    lax_unroll: unroll factor of `impl="lax"` (1 was fastest on CPU, see module doc).
    pallas_time_chunk: time steps per Pallas block, a power of two >= 16 (shorter
      sequences use one block of the next power of two). Mosaic GPU may shrink it so
      the backward's blocks fit in shared memory.
    pallas_channel_block: channels per Pallas block, a power of two >= 128
      (lane-dense; narrower layers use one padded block of 128). On TPU a block grows
      to 8 rows of 128 (1024 channels) unless it spans all of D; where 8 rows do not
      divide D, the sequential (TPU) launch takes a divisor of D's rows from 8 to 16
      instead of padding D (`pallas_scan._block_rows`); Mosaic GPU uses one row of 128.
    pallas_strategy: "auto", "sequential" (one pass, state carried across time blocks
      in on-chip scratch: the TPU design), "chunked" (reduce-then-scan over time
      chunks, many independent programs; reads a and x twice) or "lookback" (GPU
      Triton: single pass, many programs chained by decoupled look-back through
      global atomics; chunks of at most 32 steps and 128 channels, held in
      registers). "auto" is "sequential" on TPU and "chunked" on GPU: on an H200
      "lookback" ran right with 1536 programs in flight and is the faster forward
      (1.33x the copy floor against 2.24x), but forward+backward is 9% slower than
      "chunked" (benchmarks/RESULTS.md, "On a GPU").
    pallas_gpu_backend: "auto" (Triton where this JAX still ships it, else Mosaic
      GPU), "triton" or "mosaic_gpu".
    pallas_interpret: None = interpret mode exactly when the target platform is CPU.
    lowering_platform: the platform the scan is traced and lowered for: None = the
      default backend; "tpu", "gpu" (or "cuda", "rocm") or "cpu" cross-lower from a
      host without that device, e.g. to `jax.export` a TPU or GPU program from a CPU
      machine (tiling, strategy and compiler parameters depend on the target, and
      tracing happens on the host).
  """
  lax_unroll: int = 1
  pallas_time_chunk: int = 128
  pallas_channel_block: int = 128
  pallas_strategy: str = "auto"
  pallas_gpu_backend: str = "auto"
  pallas_interpret: Optional[bool] = None
  lowering_platform: Optional[str] = None

  def __post_init__(self):
    if self.lax_unroll < 1:
      raise ValueError(f"ScanOptions.lax_unroll must be >= 1, got {self.lax_unroll}.")
    if not _is_power_of_two(self.pallas_time_chunk) or self.pallas_time_chunk < 16:
      raise ValueError("ScanOptions.pallas_time_chunk must be a power of two >= 16 "
                       f"(Triton block shapes), got {self.pallas_time_chunk}.")
    if (not _is_power_of_two(self.pallas_channel_block)
        or self.pallas_channel_block < 128):
      raise ValueError("ScanOptions.pallas_channel_block must be a power of two >= 128 "
                       f"(lane-dense, Triton block shapes), got {self.pallas_channel_block}.")
    if self.pallas_strategy not in ("auto", "sequential", "chunked", "lookback"):
      raise ValueError("ScanOptions.pallas_strategy must be 'auto', 'sequential', "
                       f"'chunked' or 'lookback', got {self.pallas_strategy!r}.")
    if self.pallas_gpu_backend not in ("auto", "triton", "mosaic_gpu"):
      raise ValueError("ScanOptions.pallas_gpu_backend must be 'auto', 'triton' or "
                       f"'mosaic_gpu', got {self.pallas_gpu_backend!r}.")
    if self.lowering_platform is not None and self.lowering_platform not in PLATFORMS:
      raise ValueError(f"ScanOptions.lowering_platform must be one of {sorted(PLATFORMS)} "
                       f"or None (the default backend), got {self.lowering_platform!r}.")


def kernel_target(options: ScanOptions) -> Optional[str]:
  """The kernel target of `options` (None for a default backend with no kernels)."""
  return PLATFORMS.get(options.lowering_platform or jax.default_backend())


def resolve_platform(options: ScanOptions) -> str:
  """"tpu", "gpu" or "cpu": the platform the Pallas kernels are traced and lowered for.

  Interpret mode follows it ("cpu") unless `options.pallas_interpret` says otherwise.
  """
  target = kernel_target(options)
  if target is None:
    raise ValueError(f"The Pallas scan has no lowering for the default backend "
                     f"{jax.default_backend()!r}; set ScanOptions.lowering_platform to one "
                     f"of {sorted(PLATFORMS)}, or use a non-Pallas scan impl.")
  return target
