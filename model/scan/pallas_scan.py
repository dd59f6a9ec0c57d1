"""The Pallas linear scan: tiling, the two launch strategies, and the custom VJP.

Why a kernel: the recurrence moves 3 values per element for ~3 FLOPs, so it is memory
bound; a kernel that keeps the state on chip reads a and x once and writes h once.

Layout: arrays are [B, T, D] with channels on lanes, tiled in blocks of `bd` channels
(128 or more; D is padded up to a multiple) and C time steps (T padded with a = 1,
x = 0, which leaves the state unchanged, so the last state is still right). Decays are
float32 even for bf16 x (bf16 rounds every a above ~0.998 to 1). Complex scans run on
separate real and imaginary planes.

Strategies (ScanOptions.pallas_strategy):
- "sequential" (TPU, Mosaic): grid (B, D/bd, T/C), time innermost and "arbitrary";
  the state lives in a VMEM scratch across time blocks. One pass: read a, x, write h.
- "chunked" (GPU): reduce then scan. A summary kernel gives each time chunk its decay
  product and final state from zero; a tiny associative scan over chunks (XLA, on
  [B, T/C, D]) gives every chunk its true start state; the chunk kernel then re-scans
  each chunk from it. Every (batch, channel block, chunk) is an independent program,
  so the GPU is full even at B = 1, at the price of reading a and x twice.

Backward (custom VJP): g_t = dy_t + conj(a_{t+1}) g_{t+1} run against scan order,
dx = g, da = g conj(h_{t-1}), dh0 = conj(a_0) g_0, as one fused kernel that reads dy,
a and h once (h_{t-1} at chunk edges comes from a [B, T/C, D] side input), with the
same two strategies. h is saved in x's dtype, so bf16 runs see bf16-rounded h_{t-1}
in da (within the 1e-2 bf16 tolerance).

On CPU every kernel runs in Pallas interpret mode (tests only). The TPU (Mosaic),
GPU Triton and Mosaic GPU lowerings are selected by `pallas_compat`.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from model.scan import engine
from model.scan import pallas_compat
from model.scan import pallas_kernels
from model.scan.pallas_kernels import Tiling

_F32 = jnp.float32


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _next_power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


class _Launch:
  """Static launch description: tiling, padding and where the kernels lower to."""

  def __init__(self, batch: int, time: int, channels: int, x_dtype, components: int,
               reverse: bool, options: engine.ScanOptions):
    target = pallas_compat.platform()
    self.interpret = (options.pallas_interpret if options.pallas_interpret is not None
                      else target == "cpu")
    strategy = options.pallas_strategy
    if strategy == "auto":
      strategy = "chunked" if target == "gpu" else "sequential"
    if strategy == "sequential" and target == "gpu" and not self.interpret:
      raise ValueError("ScanOptions.pallas_strategy='sequential' needs an on-chip "
                       "scratch carried across grid steps, which Pallas GPU lacks; use "
                       "'chunked' or 'auto' on GPU.")
    self.target = target
    self.gpu_backend = (pallas_compat.resolve_gpu_backend(options.pallas_gpu_backend)
                        if target == "gpu" else None)
    sequential = strategy == "sequential"
    chunk = min(options.pallas_time_chunk, max(16, _next_power_of_two(time)))
    block = min(options.pallas_channel_block, _next_power_of_two(_round_up(channels, 128)))
    # TPU tiles hold 8 rows of 32-bit or 16 rows of 16-bit values; GPU loads one row.
    group = 1 if not sequential else (8 if jnp.dtype(x_dtype).itemsize >= 4 else 16)
    self.batch, self.time, self.channels = batch, time, channels
    self.padded_time = _round_up(time, chunk)
    self.padded_channels = _round_up(channels, block)
    self.tiling = Tiling(chunk=chunk, block=block, group=group,
                         num_chunks=self.padded_time // chunk, components=components,
                         reverse=reverse, sequential=sequential)

  @property
  def grid(self) -> tuple[int, int, int]:
    return (self.batch, self.padded_channels // self.tiling.block, self.tiling.num_chunks)

  def time_block(self, ascending: bool) -> pl.BlockSpec:
    """[B, T, D] block of one chunk; sequential launches visit chunks in sweep order."""
    nc = self.tiling.num_chunks
    flip = self.tiling.sequential and not ascending
    return pl.BlockSpec(
        (pallas_compat.squeezed_dim(), self.tiling.chunk, self.tiling.block),
        lambda b, d, k: (b, nc - 1 - k if flip else k, d))

  def state_block(self) -> pl.BlockSpec:
    """[B, 1, D] block: h0, last state, their cotangents."""
    return pl.BlockSpec((pallas_compat.squeezed_dim(), 1, self.tiling.block),
                        lambda b, d, k: (b, 0, d))

  def chunk_state_block(self, ascending: bool) -> pl.BlockSpec:
    """[B, T/C, 1, D] block: one state per chunk (summaries, start states, edges)."""
    nc = self.tiling.num_chunks
    flip = self.tiling.sequential and not ascending
    sq = pallas_compat.squeezed_dim()
    return pl.BlockSpec((sq, sq, 1, self.tiling.block),
                        lambda b, d, k: (b, nc - 1 - k if flip else k, 0, d))

  def call(self, kernel, in_specs, out_specs, out_shape, scratch: int = 0):
    semantics = ("parallel", "parallel",
                 "arbitrary" if self.tiling.sequential else "parallel")
    scratch_shapes = [pallas_compat.state_scratch((1, self.tiling.block))
                      for _ in range(scratch)]
    return pl.pallas_call(
        functools.partial(kernel, tiling=self.tiling), grid=self.grid,
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=scratch_shapes, interpret=self.interpret,
        compiler_params=(None if self.interpret else pallas_compat.compiler_params(
            self.target, semantics, self.gpu_backend)))

  def shape(self, dtype, *, per_chunk: bool = False, state: bool = False):
    b, dp = self.batch, self.padded_channels
    if state:
      return jax.ShapeDtypeStruct((b, 1, dp), dtype)
    if per_chunk:
      return jax.ShapeDtypeStruct((b, self.tiling.num_chunks, 1, dp), dtype)
    return jax.ShapeDtypeStruct((b, self.padded_time, dp), dtype)


def _as_complex(value):
  return value[0] if len(value) == 1 else jax.lax.complex(value[0], value[1])


def _components(z, n: int):
  return (z,) if n == 1 else (jnp.real(z), jnp.imag(z))


def _scan_over_chunks(prod, local, init, ascending: bool):
  """Start state of every chunk and the final state, from per-chunk summaries.

  prod, local: component tuples [B, N, 1, D]; init: component tuple [B, 1, D].
  """
  n = len(prod)
  p = _as_complex(tuple(v[:, :, 0] for v in prod))
  l = _as_complex(tuple(v[:, :, 0] for v in local))
  h0 = _as_complex(tuple(v[:, 0] for v in init))
  ends, final = engine.associative_linear_scan(p, l, h0, not ascending, p.dtype)
  if ascending:
    starts = jnp.concatenate([h0[:, None], ends[:, :-1]], axis=1)
  else:
    starts = jnp.concatenate([ends[:, 1:], h0[:, None]], axis=1)
  starts = tuple(v[:, :, None] for v in _components(starts, n))
  return starts, tuple(v[:, None] for v in _components(final, n))


def _forward(launch: _Launch, a, x, h0):
  """a, x: component tuples [B, Tp, Dp]; h0: [B, 1, Dp]. Returns (h, last)."""
  n, t = launch.tiling.components, launch.tiling
  ascending = not t.reverse
  h_shape = [launch.shape(x[0].dtype)] * n
  if t.sequential:
    outs = launch.call(
        pallas_kernels.forward_kernel,
        in_specs=[launch.time_block(ascending)] * 2 * n + [launch.state_block()] * n,
        out_specs=[launch.time_block(ascending)] * n + [launch.state_block()] * n,
        out_shape=h_shape + [launch.shape(_F32, state=True)] * n, scratch=n)(*a, *x, *h0)
    return tuple(outs[:n]), tuple(outs[n:])
  summary = launch.call(
      functools.partial(pallas_kernels.summary_kernel, backward=False),
      in_specs=[launch.time_block(True)] * 2 * n,
      out_specs=[launch.chunk_state_block(True)] * 2 * n,
      out_shape=[launch.shape(_F32, per_chunk=True)] * 2 * n)(*a, *x)
  starts, last = _scan_over_chunks(summary[:n], summary[n:], h0, ascending)
  h = launch.call(
      pallas_kernels.forward_kernel,
      in_specs=[launch.time_block(True)] * 2 * n + [launch.chunk_state_block(True)] * n,
      out_specs=[launch.time_block(True)] * n, out_shape=h_shape)(*a, *x, *starts)
  return tuple(h), last


def _chunk_edges(launch: _Launch, h, h0):
  """State before each chunk's first step in scan order: [B, T/C, 1, Dp] per component."""
  c, nc = launch.tiling.chunk, launch.tiling.num_chunks
  edges = []
  for h_c, h0_c in zip(h, h0):
    if launch.tiling.reverse:
      inner = h_c[:, c::c].astype(_F32)
      e = jnp.concatenate([inner, h0_c], axis=1)
    else:
      inner = h_c[:, c - 1:(nc - 1) * c:c].astype(_F32)
      e = jnp.concatenate([h0_c, inner], axis=1)
    edges.append(e[:, :, None])
  return tuple(edges)


def _backward(launch: _Launch, a, h, h0, dy, dlast):
  """Cotangents (da, dx, dh0) of `_forward`'s (h, last)."""
  n, t = launch.tiling.components, launch.tiling
  sweep_ascending = t.reverse
  edges = _chunk_edges(launch, h, h0)
  out_shape = [launch.shape(dy[0].dtype)] * n + [launch.shape(_F32)] * n
  tb = launch.time_block(sweep_ascending)
  cb = launch.chunk_state_block(sweep_ascending)
  if t.sequential:
    outs = launch.call(
        pallas_kernels.backward_kernel,
        in_specs=[tb] * 3 * n + [cb] * n + [launch.state_block()] * n,
        out_specs=[tb] * 2 * n + [launch.state_block()] * n,
        out_shape=out_shape + [launch.shape(_F32, state=True)] * n,
        scratch=n)(*a, *dy, *h, *edges, *dlast)
    return tuple(outs[n:2 * n]), tuple(outs[:n]), tuple(outs[2 * n:])
  summary = launch.call(
      functools.partial(pallas_kernels.summary_kernel, backward=True),
      in_specs=[tb] * 2 * n, out_specs=[cb] * 2 * n,
      out_shape=[launch.shape(_F32, per_chunk=True)] * 2 * n)(*a, *dy)
  starts, dh0 = _scan_over_chunks(summary[:n], summary[n:], dlast, sweep_ascending)
  outs = launch.call(
      pallas_kernels.backward_kernel,
      in_specs=[tb] * 3 * n + [cb] * 2 * n, out_specs=[tb] * 2 * n,
      out_shape=out_shape)(*a, *dy, *h, *edges, *starts)
  return tuple(outs[n:]), tuple(outs[:n]), dh0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan(launch: _Launch, a, x, h0):
  return _forward(launch, a, x, h0)


def _scan_fwd(launch, a, x, h0):
  h, last = _forward(launch, a, x, h0)
  return (h, last), (a, h, h0)


def _scan_bwd(launch, residuals, cotangents):
  a, h, h0 = residuals
  dy, dlast = cotangents
  return _backward(launch, a, h, h0, dy, dlast)


_scan.defvjp(_scan_fwd, _scan_bwd)


def _run(a: tuple, x: tuple, h0: Optional[tuple], reverse: bool):
  """Pads component tuples, launches, and crops. Returns (h tuple, last tuple)."""
  batch, time, channels = x[0].shape
  launch = _Launch(batch, time, channels, x[0].dtype, len(x), reverse,
                   engine.ScanOptions())
  pad_t, pad_d = launch.padded_time - time, launch.padded_channels - channels

  def pad(v, value):
    if not (pad_t or pad_d):
      return v
    return jnp.pad(v, ((0, 0), (0, pad_t), (0, pad_d)), constant_values=value)

  # Padded steps have a = 1 (real part) and x = 0: the state passes through unchanged.
  a_p = tuple(pad(v.astype(_F32), 1.0 if c == 0 else 0.0) for c, v in enumerate(a))
  x_p = tuple(pad(v, 0) for v in x)
  if h0 is None:
    h0_p = tuple(jnp.zeros((batch, 1, launch.padded_channels), _F32) for _ in x)
  else:
    h0_p = tuple(jnp.pad(v.astype(_F32), ((0, 0), (0, pad_d)))[:, None] for v in h0)
  h, last = _scan(launch, a_p, x_p, h0_p)
  return (tuple(v[:, :time, :channels] for v in h),
          tuple(v[:, 0, :channels] for v in last))


def pallas_linear_scan(a: jax.Array, x: jax.Array, h0: Optional[jax.Array] = None, *,
                       reverse: bool = False) -> tuple[jax.Array, jax.Array]:
  """`linear_scan` with the Pallas kernel (same contract; see `engine.linear_scan`)."""
  if not (jnp.iscomplexobj(a) or jnp.iscomplexobj(x)):
    (h,), (last,) = _run((a,), (x,), None if h0 is None else (h0,), reverse)
    return h, last
  split = lambda z: (jnp.real(z).astype(_F32), jnp.imag(z).astype(_F32))
  (h_re, h_im), (l_re, l_im) = _run(split(a), split(x),
                                    None if h0 is None else split(h0), reverse)
  return jax.lax.complex(h_re, h_im), jax.lax.complex(l_re, l_im)


def pallas_linear_scan_pairs(a: tuple[jax.Array, jax.Array], x: tuple[jax.Array, jax.Array],
                             h0: Optional[tuple[jax.Array, jax.Array]] = None, *,
                             reverse: bool = False):
  """Complex scan on (real, imaginary) planes; see `engine.linear_scan_pairs`."""
  if x[0].dtype != x[1].dtype:
    raise ValueError(f"linear_scan_pairs: x's real and imaginary parts differ in dtype "
                     f"({x[0].dtype} vs {x[1].dtype}); cast them to one dtype.")
  return _run(tuple(a), tuple(x), None if h0 is None else tuple(h0), reverse)
