"""What differs between JAX versions and Pallas backends, detected once, in one place.

The CPU machines run JAX 0.10 and the GPU machines JAX 0.11, where the default Pallas
GPU backend is Mosaic GPU and Triton is deprecated. Nothing here compares version
numbers: each helper looks for the API it needs, so a renamed class fails loudly here
instead of deep inside a lowering.
"""
from __future__ import annotations

from typing import Any, Optional

import importlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def squeezed_dim() -> Any:
  """The block-shape entry for a dimension the kernel does not see (batch)."""
  squeezed = getattr(pl, "Squeezed", None)
  return squeezed() if squeezed is not None else None


def triton_available() -> bool:
  """Whether this JAX ships the Pallas Triton backend (deprecated from JAX 0.11)."""
  try:
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  return hasattr(pltriton, "CompilerParams")


def resolve_gpu_backend(requested: str) -> str:
  """"triton" where this JAX ships it, else "mosaic_gpu" (an explicit request is
  checked against what this JAX ships)."""
  if requested == "auto":
    return "triton" if triton_available() else "mosaic_gpu"
  if requested == "triton" and not triton_available():
    raise ValueError("ScanOptions.pallas_gpu_backend='triton' but this JAX "
                     f"({jax.__version__}) ships no Pallas Triton backend; use 'auto' or "
                     "'mosaic_gpu'.")
  return requested


def compiler_params(target: str, dimension_semantics: tuple[str, ...],
                    gpu_backend: str) -> Optional[Any]:
  """Compiler parameters for `pl.pallas_call` on `target` ("tpu", "gpu" or "cpu").

  On GPU the parameter's type is what selects the backend (Triton or Mosaic GPU) in
  JAX 0.10 and 0.11, so it is always passed explicitly there.
  """
  if target == "tpu":
    from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
    params_cls = getattr(pltpu, "CompilerParams", None) or getattr(
        pltpu, "TPUCompilerParams")
    return params_cls(dimension_semantics=dimension_semantics)
  if target == "gpu":
    if gpu_backend == "triton":
      from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
      return pltriton.CompilerParams(num_warps=4, num_stages=2)
    from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
    reason = mosaic_gpu_unavailable()
    if reason:
      raise ValueError(f"ScanOptions.pallas_gpu_backend='mosaic_gpu', but this JAX "
                       f"({jax.__version__}) cannot lower Mosaic GPU kernels ({reason}); "
                       "use pallas_gpu_backend='triton' or 'auto'.")
    return plgpu.CompilerParams()
  return None


def mosaic_gpu_unavailable() -> Optional[str]:
  """None when this JAX can lower Mosaic GPU kernels, else why not.

  Importing the registration module registers Mosaic GPU's pallas_call lowering; JAX
  0.11's GPU lowering does not import it itself, so without this a Mosaic GPU kernel
  fails with a bare `assert rule is not None`. The import fails where the installed
  jaxlib/CUDA plugin has no Mosaic GPU support (seen on an H200 image with JAX 0.11.2
  and jax-cuda13-plugin): that must be a clear error, not an assertion.
  """
  try:
    importlib.import_module("jax._src.pallas.mosaic_gpu.pallas_call_registration")
  except ImportError as error:
    return f"{type(error).__name__}: {error}"
  return None


def state_scratch(shape: tuple[int, ...]) -> Any:
  """On-chip float32 scratch for a state carried across grid steps (TPU VMEM)."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  return pltpu.VMEM(shape, jnp.float32)
