"""`linear_scan`: one entry point, several implementations of h_t = a_t * h_{t-1} + x_t.

Every recurrent layer calls `linear_scan`; which algorithm runs is a keyword, so a
kernel can be swapped without touching the layers:

- "lax": `jax.lax.scan`, one step per iteration, with an unroll factor ("lax" uses
  `options.lax_unroll`, "lax:16" names it). Sequential and exact; its cost on an
  accelerator is per-step latency, on CPU it is the fastest measured (see "auto").
- "associative": `jax.lax.associative_scan` over (a, x) pairs. log2(T) passes over the
  data, so it moves several times the bytes of a sequential scan; useful where the
  per-step latency of "lax" dominates and there is no kernel.
- "pallas": the Pallas kernel of `model.scan.pallas_scan` (state kept on chip, custom
  VJP with a fused backward). On CPU it only runs in interpret mode (slow; for tests).
- "auto": "pallas" only where the kernel has been compiled by the device's own compiler
  in this project's tests and is expected to beat XLA's scans there:
  - TPU, whose Mosaic compiler builds the kernel inside the whole train step for every
    mesh in tests/test_tpu_compile.py;
  - NVIDIA GPUs of the compute capabilities in `VERIFIED_CUDA_CAPABILITIES`, whose
    XLA:GPU, Triton / Mosaic GPU and ptxas build the kernels (the "chunked" strategy)
    inside the whole train step of every tiny model and mesh in
    tests/test_gpu_compile.py (H100; A100, H200 and B200 for the kernels alone;
    Mosaic GPU needs Hopper or later). Expected to win, from the compiled programs
    (XLA:GPU for one H100, B=4, T=2048, D=1024, bf16 x; benchmarks/RESULTS.md, "GPU
    compile"):
    "lax" compiles to a while loop of 2048 trips, forward and again backward, each
    trip a launch of fused kernels over only B x D = 4096 elements, so its time is
    2048 dependent launches (microseconds each) per layer and direction; the
    associative scan has no loop but log2(T) passes, and 27 MiB of temporaries
    forward against the kernel's 16; the Pallas kernel is 2 launches forward
    and 2 backward, whose bytes (14 per element forward for bf16 x) take tens of
    microseconds at H100 bandwidth. Measured since on an H200 (JAX 0.11.2, Triton;
    benchmarks/RESULTS.md, "On a GPU"), B=8, T=16384, D=4096, bf16 x, forward+backward:
    "chunked" 6.68 ms, associative 10.51 ms, lax 630 ms, recurrentgemma's native
    scan 27.1 ms; and a whole training step of a small Griffin (float32, 8 x 1024,
    benchmarks/gpu_shard_map_step.py) took 3.53 ms with the kernel, 61.0 ms with lax.
  Elsewhere (CPU, ROCm, other NVIDIA generations) "lax" with the default unroll of 1,
  the fastest XLA path measured: in `benchmarks/scan.py --quick` on this project's
  2-core CPU machine (B=8, D=1024, float32; benchmarks/RESULTS.md, "## Scan")
  lax.scan at unroll 1 was the fastest forward and forward+backward: 1.2-2.4x ahead
  of unroll 8, 1.4-2.2x ahead of the associative scan, 7-18x ahead of unroll 128
  (whose huge loop body also compiles for one to two minutes). Pallas on CPU is
  interpret mode only.

Numerics: the state is accumulated in float32 (complex64 for complex inputs) whatever
the input dtype; `h` comes back in x's dtype (complex64 when only `a` is complex) and
`h_last` in the accumulation dtype, so chaining segments through `h0` loses nothing.
Document resets are the caller's business: a_t = 0 starts afresh at t.

Options are an argument, never read from Gin here: a jitted scan's program is fixed by
its arguments, which jit caches key on (Gin bindings made after tracing are not). Gin
can bind `ScanOptions.*`, but only entry points build options from it
(`pretrain.gin_config`); a model passes its `ModelConfig.scan`.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from model.scan.options import IMPLS
from model.scan.options import ScanOptions
from model.scan.options import VERIFIED_CUDA_CAPABILITIES
from model.scan.options import kernel_target
from model.scan.xla_scans import accumulation_dtype
from model.scan.xla_scans import associative_linear_scan
from model.scan.xla_scans import lax_linear_scan
from model.scan.xla_scans import validate

def parse_impl(impl: str) -> tuple[str, Optional[int]]:
  """Splits "lax:16" into ("lax", 16); other names carry no unroll."""
  name, _, unroll = impl.partition(":")
  if name not in IMPLS:
    raise ValueError(f"Unknown scan impl {impl!r}; choose one of {IMPLS} "
                     "(or 'lax:N' for lax.scan unrolled N times).")
  if not unroll:
    return name, None
  if name != "lax" or not unroll.isdigit() or int(unroll) < 1:
    raise ValueError(f"Scan impl {impl!r}: only 'lax' takes an unroll, as 'lax:N' "
                     "with N >= 1.")
  return name, int(unroll)


def _local_cuda_capability() -> Optional[str]:
  """The compute capability of this host's first GPU ("9.0"; a ROCm GPU's architecture
  name, if any, matches no entry of `VERIFIED_CUDA_CAPABILITIES`)."""
  return getattr(jax.local_devices()[0], "compute_capability", None)


def _auto_picks_pallas(options: ScanOptions) -> bool:
  """Whether "auto" is the Pallas kernel for `options`' target (module docstring)."""
  target = kernel_target(options)
  if target == "tpu":
    return True
  if target != "gpu" or options.lowering_platform == "rocm":
    return False
  from model.scan import pallas_compat  # pylint: disable=g-import-not-at-top
  backend = pallas_compat.resolve_gpu_backend(options.pallas_gpu_backend)
  if options.lowering_platform is not None:
    # Cross-lowering for "gpu" / "cuda": the targets this project compiles for
    # (pretrain/compilation/gpu_specs) are the verified generations.
    return True
  return _local_cuda_capability() in VERIFIED_CUDA_CAPABILITIES[backend]


def resolve_impl(impl: str, options: ScanOptions) -> tuple[str, Optional[int]]:
  """Resolves "auto" for the target platform (see the module docstring for why)."""
  name, unroll = parse_impl(impl)
  if name == "auto":
    name = "pallas" if _auto_picks_pallas(options) else "lax"
  return name, unroll


def linear_scan(a: jax.Array, x: jax.Array, h0: Optional[jax.Array] = None, *,
                options: ScanOptions, reverse: bool = False,
                impl: str = "auto") -> tuple[jax.Array, jax.Array]:
  """Computes h_t = a_t * h_{t-1} + x_t over the time axis (h_{-1} = h0).

  Args:
    a: decays [B, T, D], real or complex. Kept in float32 by every implementation
      (rounding decays near 1 to bf16 would turn them into exactly 1).
    x: inputs [B, T, D], float32, bfloat16 or complex.
    h0: state before the first step [B, D]; zeros when None.
    options: the implementations' tunables and target platform (a model passes its
      `ModelConfig.scan`).
    reverse: scan from t = T-1 down to 0 (h_t = a_t * h_{t+1} + x_t).
    impl: "auto", "lax", "lax:N", "associative" or "pallas" (module docstring).

  Returns:
    (h [B, T, D] in x's dtype, h_last [B, D] in float32/complex64), where h_last is
    the state after the last step in scan order (t = 0 when `reverse`).
  """
  validate(a, x, h0)
  name, unroll = resolve_impl(impl, options)
  acc = accumulation_dtype(a, x)
  out_dtype = x.dtype if acc == jnp.float32 or jnp.iscomplexobj(x) else acc
  if name == "pallas":
    from model.scan import pallas_scan  # pylint: disable=g-import-not-at-top
    return pallas_scan.pallas_linear_scan(a, x, h0, options=options, reverse=reverse)
  if h0 is None:
    h0 = jnp.zeros((x.shape[0], x.shape[2]), acc)
  h0 = h0.astype(acc)
  if name == "associative":
    h, h_last = associative_linear_scan(a, x, h0, reverse, acc)
  else:
    unroll = unroll or options.lax_unroll
    h, h_last = lax_linear_scan(a, x, h0, reverse, unroll, acc)
  return h.astype(out_dtype), h_last


def linear_scan_pairs(a: tuple[jax.Array, jax.Array], x: tuple[jax.Array, jax.Array],
                      h0: Optional[tuple[jax.Array, jax.Array]] = None, *,
                      options: ScanOptions, reverse: bool = False, impl: str = "auto"):
  """Complex `linear_scan` on (real, imaginary) pairs, for layers that keep them apart.

  Args:
    a: (a_re, a_im), each [B, T, D].
    x: (x_re, x_im), each [B, T, D].
    h0: optional (h0_re, h0_im), each [B, D].
    options: as in `linear_scan`.
    reverse: as in `linear_scan`.
    impl: as in `linear_scan`.

  Returns:
    ((h_re, h_im) in x's dtype, (h_last_re, h_last_im) in float32).
  """
  name, _ = resolve_impl(impl, options)
  if name == "pallas":
    from model.scan import pallas_scan  # pylint: disable=g-import-not-at-top
    return pallas_scan.pallas_linear_scan_pairs(a, x, h0, options=options, reverse=reverse)
  to_complex = lambda pair: jax.lax.complex(pair[0].astype(jnp.float32),
                                            pair[1].astype(jnp.float32))
  h, h_last = linear_scan(to_complex(a), to_complex(x),
                          None if h0 is None else to_complex(h0),
                          options=options, reverse=reverse, impl=impl)
  dtype = x[0].dtype
  return ((h.real.astype(dtype), h.imag.astype(dtype)), (h_last.real, h_last.imag))
