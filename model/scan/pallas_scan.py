"""The Pallas linear scan: tiling, the two launch strategies, and the custom VJP.

Why a kernel: the recurrence moves 3 values per element for ~3 FLOPs, so it is memory
bound; a kernel that keeps the state on chip reads a and x once and writes h once.

Layout: [B, T, D] is padded to [B, Tp, 128 R] (T with a = 1, x = 0, which leaves
the state unchanged, so the last state is still right; D with zeros), channels being
R rows of 128 lanes, and handed to the kernels in a view that costs nothing where they
run (`_Launch.to_kernel`):
- sequential (TPU): [B, Tp/8, R, 8, 128], a reshape and transpose that is exactly the
  memory of XLA:TPU's (8, 128)-tiled [B, T, D] (a tile holds 8 time steps of 128
  channels), so XLA compiles it to a bitcast. A block is C/8 tiles by `rows` rows; the
  kernels load a tile of every row at once and take its 8 steps apart in registers
  (`pallas_kernels.forward_tiles`). The earlier [B, Tp, R, 128] view on TPU cost a
  relayout copy of a and x and of h: 70-77% of the scan program's HBM bytes
  (benchmarks/RESULTS.md, "Pallas cost estimates").
- chunked (GPU): [B, Tp, R, 128], free in a row-major layout; a step of the kernel is
  one [rows, 128] row at a dynamic time index (`pallas_kernels.forward_rows`).
On TPU a block has 8 rows or more (a step then fills an (8, 128) float32 register),
unless it spans all R; where 8 does not divide R, a sequential block takes a divisor
of R from 8 to 16 rows instead, so that channels are not padded (`_block_rows`). Mosaic GPU stages whole blocks in shared memory, so there a
block is one row and the chunk shrinks until the backward's blocks fit. Decays are
float32 even for bf16 x (bf16 rounds every a above ~0.998 to 1). Complex scans run
on separate real and imaginary planes.

Strategies (ScanOptions.pallas_strategy):
- "sequential" (TPU, Mosaic): grid (B, R/rows, T/C), time innermost and "arbitrary";
  the state lives in a VMEM scratch across time blocks. One pass: read a, x, write h.
- "chunked" (GPU): reduce then scan. A summary kernel gives each time chunk its decay
  product and final state from zero; a tiny associative scan over chunks (XLA, on
  [B, T/C, D]) gives every chunk its true start state; the chunk kernel then re-scans
  each chunk from it. Every (batch, channel block, chunk) is an independent program,
  so the GPU is full even at B = 1, at the price of reading a and x twice.
- "lookback" (GPU Triton): as many programs as "chunked", in a single pass: each
  program takes its chunk's start state from its predecessors' published states
  through global atomics (`pallas_lookback`). "auto" stays "chunked" on GPU until
  the look-back kernel has been measured on one.

Backward (custom VJP): g_t = dy_t + conj(a_{t+1}) g_{t+1} run against scan order,
dx = g, da = g conj(h_{t-1}), dh0 = conj(a_0) g_0, as one fused kernel that reads dy,
a and h once (h_{t-1} at chunk edges comes from a [B, T/C, D] side input), with the
same strategies. h is saved in x's dtype, so bf16 runs see bf16-rounded h_{t-1}
in da (within the 1e-2 bf16 tolerance).

On CPU every kernel runs in Pallas interpret mode (tests only). The TPU (Mosaic),
GPU Triton and Mosaic GPU lowerings are selected by `pallas_compat` for the target
platform of the `ScanOptions`, which can also cross-lower from a CPU host
(`lowering_platform`; tests/test_scan_lowering.py exports them there).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from model.scan import pallas_compat
from model.scan import pallas_kernels
from model.scan.pallas_kernels import Tiling
from model.scan.options import ScanOptions
from model.scan.options import resolve_platform
from model.scan.xla_scans import associative_linear_scan

_F32 = jnp.float32


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _next_power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


_LANES = 128


def _lookback():
  """`pallas_lookback`, imported on use: it needs Pallas Triton, which later JAX
  releases may not ship (the other strategies do not)."""
  from model.scan import pallas_lookback  # pylint: disable=g-import-not-at-top
  return pallas_lookback


def _block_rows(lanes: int, requested: int, target: str, sequential: bool) -> int:
  """128-lane rows per channel block: the requested block, at most the width
  (rounded up to a power of two, as Triton block shapes must be). On TPU a block
  narrower than the whole width grows to 8 rows, so that a step fills an (8, 128)
  float32 register; chunked launches ([C, rows, 128] blocks) also need that for
  Mosaic's block-shape rule. Sequential launches ([C/8, rows, 8, 128] blocks) have no
  such rule on rows: where 8 rows do not divide the width, they take the smallest
  divisor of the width of 8 rows or more (at most 16), or all of a width under 8
  rows, so that channels need no padding. Padding is a copy of a and x on the way in
  and of h on the way out, and every launch reads and writes it: 20% of the scan's
  bytes at D_RNN = 2560 (R = 20 padded to 24; benchmarks/RESULTS.md, "RG-LRU layout")."""
  rows = min(requested, _next_power_of_two(lanes))
  if target == "tpu" and rows < lanes:
    wanted = max(rows, 8)
    if sequential and lanes % wanted:
      fits = [d for d in range(min(wanted, lanes), min(2 * wanted, lanes) + 1)
              if lanes % d == 0]
      if fits:
        return fits[0]
    rows = min(wanted, _next_power_of_two(lanes))
  return rows


# Mosaic GPU stages every block of a grid step in shared memory (227 KiB per block on
# H100/H200, the limit its lowering enforces); the biggest kernel's blocks stay
# under this, leaving room for its barriers.
_MOSAIC_GPU_SMEM_BUDGET = 192 * 1024
_MIN_CHUNK = 16


def _mosaic_gpu_chunk(chunk: int, components: int, x_itemsize: int) -> int:
  """The longest chunk, at most the requested one, whose fused-backward blocks (one
  128-channel row) fit `_MOSAIC_GPU_SMEM_BUDGET`: per step a and da (float32) and
  dy, h, dx (x's dtype), plus two float32 per-chunk states."""

  def needed(c: int) -> int:
    return components * _LANES * (c * (8 + 3 * x_itemsize) + 2 * 4)

  while chunk > _MIN_CHUNK and needed(chunk) > _MOSAIC_GPU_SMEM_BUDGET:
    chunk //= 2
  return chunk


class _Launch:
  """Static launch description: tiling, padding and where the kernels lower to."""

  def __init__(self, batch: int, time: int, channels: int, x_dtype, components: int,
               reverse: bool, options: ScanOptions):
    target = resolve_platform(options)
    self.interpret = (options.pallas_interpret if options.pallas_interpret is not None
                      else target == "cpu")
    strategy = options.pallas_strategy
    if strategy == "auto":
      strategy = "chunked" if target == "gpu" else "sequential"
    if strategy == "sequential" and target == "gpu" and not self.interpret:
      raise ValueError("ScanOptions.pallas_strategy='sequential' needs an on-chip "
                       "scratch carried across grid steps, which Pallas GPU lacks; use "
                       "'chunked', 'lookback' or 'auto' on GPU.")
    self.target = target
    self.gpu_backend = (pallas_compat.resolve_gpu_backend(options.pallas_gpu_backend)
                        if target == "gpu" else None)
    if strategy == "lookback" and not pallas_compat.triton_available():
      raise ValueError("ScanOptions.pallas_strategy='lookback' is written with Pallas "
                       f"Triton's atomics, which this JAX ({jax.__version__}) does not "
                       "ship; use 'auto'.")
    if strategy == "lookback" and not self.interpret and self.gpu_backend != "triton":
      raise ValueError("ScanOptions.pallas_strategy='lookback' needs global atomics, "
                       "which this project's kernels use through Pallas Triton only "
                       f"(target {target!r}, GPU backend {self.gpu_backend!r}); use "
                       "'auto' here, or pallas_gpu_backend='triton' on GPU.")
    self.strategy = strategy
    sequential = strategy == "sequential"
    chunk = min(options.pallas_time_chunk, max(_MIN_CHUNK, _next_power_of_two(time)))
    if strategy == "lookback":
      chunk = min(chunk, _lookback().MAX_CHUNK)
    lanes = _round_up(channels, _LANES) // _LANES
    rows = _block_rows(lanes, options.pallas_channel_block // _LANES, target, sequential)
    if strategy == "lookback":
      # One 128-channel row per program: the chunk sits in registers, and more,
      # narrower programs are what the GPU wants anyway.
      rows = 1
    if self.gpu_backend == "mosaic_gpu" and not self.interpret:
      # One row per block: Mosaic GPU gives float32 and 16-bit loads of a multi-row
      # tile different register layouts, and arithmetic between them fails to lower.
      rows = 1
      chunk = _mosaic_gpu_chunk(chunk, components, jnp.dtype(x_dtype).itemsize)
    self.batch, self.time, self.channels = batch, time, channels
    self.padded_time = _round_up(time, chunk)
    self.padded_rows = _round_up(lanes, rows)
    self.padded_channels = self.padded_rows * _LANES
    self.tiling = Tiling(chunk=chunk, rows=rows, num_chunks=self.padded_time // chunk,
                         components=components, reverse=reverse, sequential=sequential)

  @property
  def lookback_grid(self):
    return _lookback().Grid(self.tiling, self.batch,
                            self.padded_rows // self.tiling.rows, self.interpret)

  def lookback_params(self):
    return None if self.interpret else pallas_compat.compiler_params(
        self.target, ("parallel",), self.gpu_backend)

  @property
  def grid(self) -> tuple[int, int, int]:
    return (self.batch, self.padded_rows // self.tiling.rows, self.tiling.num_chunks)

  def _chunk_index(self, k, ascending: bool):
    """Sequential launches visit time chunks in sweep order; chunked ones in any."""
    flip = self.tiling.sequential and not ascending
    return self.tiling.num_chunks - 1 - k if flip else k

  def time_block(self, ascending: bool) -> pl.BlockSpec:
    """One chunk of a time array in the kernels' layout (`to_kernel`): [C/8, rows, 8,
    128] tiles for sequential launches, [C, rows, 128] steps for chunked ones."""
    sq = pallas_compat.squeezed_dim()
    t = self.tiling
    if t.sequential:
      return pl.BlockSpec(
          (sq, t.chunk // pallas_kernels.SUBLANES, t.rows, pallas_kernels.SUBLANES, _LANES),
          lambda b, d, k: (b, self._chunk_index(k, ascending), d, 0, 0))
    return pl.BlockSpec((sq, t.chunk, t.rows, _LANES),
                        lambda b, d, k: (b, self._chunk_index(k, ascending), d, 0))

  def to_kernel(self, v: jax.Array) -> jax.Array:
    """[B, Tp, Dp] in the kernels' layout. Sequential (TPU) launches see
    [B, Tp/8, R, 8, 128]: exactly the bytes of XLA:TPU's (8, 128)-tiled [B, T, D], so
    the reshape and transpose compile to nothing (the [B, Tp, R, 128] view of the
    chunked kernels would cost a relayout copy there). Chunked (GPU) launches see
    [B, Tp, R, 128], free in a row-major layout."""
    b, tp, _ = v.shape
    r, sub = self.padded_rows, pallas_kernels.SUBLANES
    if self.tiling.sequential:
      return v.reshape(b, tp // sub, sub, r, _LANES).transpose(0, 1, 3, 2, 4)
    return v.reshape(b, tp, r, _LANES)

  def from_kernel(self, v: jax.Array) -> jax.Array:
    """The inverse of `to_kernel`: [B, Tp, Dp]."""
    if self.tiling.sequential:
      v = v.transpose(0, 1, 3, 2, 4)
    return v.reshape(self.batch, self.padded_time, self.padded_channels)

  @property
  def state_dims(self) -> tuple[int, ...]:
    """Channel dimensions of a state array ([B, *state_dims]): (R, 128), or for
    sequential launches (R/rows, rows, 128), so that a block's last two dimensions are
    the array's whole (rows, 128) whatever `rows` is (Mosaic's block-shape rule wants
    8 | rows otherwise, and `_block_rows` may pick a divisor of R that is not)."""
    if self.tiling.sequential:
      return (self.padded_rows // self.tiling.rows, self.tiling.rows, _LANES)
    return (self.padded_rows, _LANES)

  def state_block(self) -> pl.BlockSpec:
    """[B, *state_dims] block: h0, last state, their cotangents."""
    sq = pallas_compat.squeezed_dim()
    if self.tiling.sequential:
      return pl.BlockSpec((sq, sq, self.tiling.rows, _LANES), lambda b, d, k: (b, d, 0, 0))
    return pl.BlockSpec((sq, self.tiling.rows, _LANES), lambda b, d, k: (b, d, 0))

  def chunk_state_block(self, ascending: bool) -> pl.BlockSpec:
    """[B, T/C, *state_dims] block: one state per chunk (summaries, start states,
    edges)."""
    sq = pallas_compat.squeezed_dim()
    if self.tiling.sequential:
      return pl.BlockSpec((sq, sq, sq, self.tiling.rows, _LANES),
                          lambda b, d, k: (b, self._chunk_index(k, ascending), d, 0, 0))
    return pl.BlockSpec((sq, sq, self.tiling.rows, _LANES),
                        lambda b, d, k: (b, self._chunk_index(k, ascending), d, 0))

  def call(self, kernel, cost: str, in_specs, out_specs, out_shape, scratch: int = 0):
    """The launch of `kernel` over the grid; `cost` names its `flops_per_lane` entry."""
    semantics = ("parallel", "parallel",
                 "arbitrary" if self.tiling.sequential else "parallel")
    scratch_shapes = [pallas_compat.state_scratch((self.tiling.rows, _LANES))
                      for _ in range(scratch)]

    def launch(*operands):
      return pl.pallas_call(
          functools.partial(kernel, tiling=self.tiling), grid=self.grid,
          in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
          scratch_shapes=scratch_shapes, interpret=self.interpret,
          cost_estimate=self.cost_estimate(cost, operands, out_shape),
          compiler_params=(None if self.interpret else pallas_compat.compiler_params(
              self.target, semantics, self.gpu_backend)))(*operands)

    return launch

  def cost_estimate(self, kernel: str, operands, out_shape) -> pl.CostEstimate:
    """What one launch computes and moves, for XLA's cost model and scheduler.

    Every operand and result block is visited exactly once over the grid (the index
    maps tile them without overlap, and a state block that stays put across time steps
    is fetched once), so the bytes are the operands' and results' sizes.
    """
    programs = self.batch * (self.padded_rows // self.tiling.rows) * self.tiling.num_chunks
    lanes = self.tiling.rows * _LANES
    moved = sum(v.size * jnp.dtype(v.dtype).itemsize for v in [*operands, *out_shape])
    return pl.CostEstimate(
        flops=programs * lanes * pallas_kernels.flops_per_lane(kernel, self.tiling),
        transcendentals=0, bytes_accessed=int(moved))

  def shape(self, dtype, *, per_chunk: bool = False, state: bool = False):
    b, r = self.batch, self.padded_rows
    if state:
      return jax.ShapeDtypeStruct((b, *self.state_dims), dtype)
    if per_chunk:
      return jax.ShapeDtypeStruct((b, self.tiling.num_chunks, *self.state_dims), dtype)
    if self.tiling.sequential:
      sub = pallas_kernels.SUBLANES
      return jax.ShapeDtypeStruct((b, self.padded_time // sub, r, sub, _LANES), dtype)
    return jax.ShapeDtypeStruct((b, self.padded_time, r, _LANES), dtype)


def _as_complex(value):
  return value[0] if len(value) == 1 else jax.lax.complex(value[0], value[1])


def _components(z, n: int):
  return (z,) if n == 1 else (jnp.real(z), jnp.imag(z))


def _scan_over_chunks(prod, local, init, ascending: bool):
  """Start state of every chunk and the final state, from per-chunk summaries.

  prod, local: component tuples [B, N, R, 128]; init: component tuple [B, R, 128].
  """
  n = len(prod)
  p, l, h0 = _as_complex(prod), _as_complex(local), _as_complex(init)
  ends, final = associative_linear_scan(p, l, h0, not ascending, p.dtype)
  if ascending:
    starts = jnp.concatenate([h0[:, None], ends[:, :-1]], axis=1)
  else:
    starts = jnp.concatenate([ends[:, 1:], h0[:, None]], axis=1)
  return _components(starts, n), _components(final, n)


def _forward(launch: _Launch, a, x, h0):
  """a, x: component tuples [B, Tp, R, 128]; h0: [B, R, 128]. Returns (h, last)."""
  n, t = launch.tiling.components, launch.tiling
  ascending = not t.reverse
  h_shape = [launch.shape(x[0].dtype)] * n
  if launch.strategy == "lookback":
    return _lookback().forward(launch.lookback_grid, a, x, h0,
                                   compiler_params=launch.lookback_params())
  if t.sequential:
    outs = launch.call(
        pallas_kernels.forward_kernel, "forward",
        in_specs=[launch.time_block(ascending)] * 2 * n + [launch.state_block()] * n,
        out_specs=[launch.time_block(ascending)] * n + [launch.state_block()] * n,
        out_shape=h_shape + [launch.shape(_F32, state=True)] * n, scratch=n)(*a, *x, *h0)
    return tuple(outs[:n]), tuple(outs[n:])
  summary = launch.call(
      functools.partial(pallas_kernels.summary_kernel, backward=False), "summary",
      in_specs=[launch.time_block(True)] * 2 * n,
      out_specs=[launch.chunk_state_block(True)] * 2 * n,
      out_shape=[launch.shape(_F32, per_chunk=True)] * 2 * n)(*a, *x)
  starts, last = _scan_over_chunks(summary[:n], summary[n:], h0, ascending)
  h = launch.call(
      pallas_kernels.forward_kernel, "forward",
      in_specs=[launch.time_block(True)] * 2 * n + [launch.chunk_state_block(True)] * n,
      out_specs=[launch.time_block(True)] * n, out_shape=h_shape)(*a, *x, *starts)
  return tuple(h), last


def _chunk_edges(launch: _Launch, h, h0):
  """State before each chunk's first step in scan order: [B, T/C, *state_dims] each."""
  c, nc = launch.tiling.chunk, launch.tiling.num_chunks
  rows = launch.state_dims
  edges = []
  for h_c, h0_c in zip(h, h0):
    h_c = launch.from_kernel(h_c)
    if launch.tiling.reverse:
      inner = h_c[:, c::c].astype(_F32).reshape(launch.batch, nc - 1, *rows)
      edges.append(jnp.concatenate([inner, h0_c[:, None]], axis=1))
    else:
      inner = h_c[:, c - 1:(nc - 1) * c:c].astype(_F32).reshape(launch.batch, nc - 1, *rows)
      edges.append(jnp.concatenate([h0_c[:, None], inner], axis=1))
  return tuple(edges)


def _backward(launch: _Launch, a, h, h0, dy, dlast):
  """Cotangents (da, dx, dh0) of `_forward`'s (h, last)."""
  n, t = launch.tiling.components, launch.tiling
  if launch.strategy == "lookback":
    return _lookback().backward(launch.lookback_grid, a, h, h0, dy, dlast,
                                    compiler_params=launch.lookback_params())
  sweep_ascending = t.reverse
  edges = _chunk_edges(launch, h, h0)
  out_shape = [launch.shape(dy[0].dtype)] * n + [launch.shape(_F32)] * n
  tb = launch.time_block(sweep_ascending)
  cb = launch.chunk_state_block(sweep_ascending)
  if t.sequential:
    outs = launch.call(
        pallas_kernels.backward_kernel, "backward",
        in_specs=[tb] * 3 * n + [cb] * n + [launch.state_block()] * n,
        out_specs=[tb] * 2 * n + [launch.state_block()] * n,
        out_shape=out_shape + [launch.shape(_F32, state=True)] * n,
        scratch=n)(*a, *dy, *h, *edges, *dlast)
    return tuple(outs[n:2 * n]), tuple(outs[:n]), tuple(outs[2 * n:])
  summary = launch.call(
      functools.partial(pallas_kernels.summary_kernel, backward=True), "summary_backward",
      in_specs=[tb] * 2 * n, out_specs=[cb] * 2 * n,
      out_shape=[launch.shape(_F32, per_chunk=True)] * 2 * n)(*a, *dy)
  starts, dh0 = _scan_over_chunks(summary[:n], summary[n:], dlast, sweep_ascending)
  outs = launch.call(
      pallas_kernels.backward_kernel, "backward",
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


def _run(a: tuple, x: tuple, h0: Optional[tuple], reverse: bool,
         options: ScanOptions):
  """Pads component tuples, launches, and crops. Returns (h tuple, last tuple)."""
  batch, time, channels = x[0].shape
  launch = _Launch(batch, time, channels, x[0].dtype, len(x), reverse, options)
  pad_t, pad_d = launch.padded_time - time, launch.padded_channels - channels
  rows = launch.state_dims

  def pad(v, value):
    if pad_t or pad_d:
      v = jnp.pad(v, ((0, 0), (0, pad_t), (0, pad_d)), constant_values=value)
    return launch.to_kernel(v)

  # Padded steps have a = 1 (real part) and x = 0: the state passes through unchanged.
  a_p = tuple(pad(v.astype(_F32), 1.0 if c == 0 else 0.0) for c, v in enumerate(a))
  x_p = tuple(pad(v, 0) for v in x)
  if h0 is None:
    h0_p = tuple(jnp.zeros((batch, *rows), _F32) for _ in x)
  else:
    h0_p = tuple(jnp.pad(v.astype(_F32), ((0, 0), (0, pad_d))).reshape(batch, *rows)
                 for v in h0)
  h, last = _scan(launch, a_p, x_p, h0_p)
  return (tuple(launch.from_kernel(v)[:, :time, :channels] for v in h),
          tuple(v.reshape(batch, launch.padded_channels)[:, :channels] for v in last))


def pallas_linear_scan(a: jax.Array, x: jax.Array, h0: Optional[jax.Array] = None, *,
                       options: ScanOptions,
                       reverse: bool = False) -> tuple[jax.Array, jax.Array]:
  """`linear_scan` with the Pallas kernel (same contract; see `engine.linear_scan`)."""
  if not (jnp.iscomplexobj(a) or jnp.iscomplexobj(x)):
    (h,), (last,) = _run((a,), (x,), None if h0 is None else (h0,), reverse, options)
    return h, last
  split = lambda z: (jnp.real(z).astype(_F32), jnp.imag(z).astype(_F32))
  (h_re, h_im), (l_re, l_im) = _run(split(a), split(x),
                                    None if h0 is None else split(h0), reverse, options)
  return jax.lax.complex(h_re, h_im), jax.lax.complex(l_re, l_im)


def pallas_linear_scan_pairs(a: tuple[jax.Array, jax.Array], x: tuple[jax.Array, jax.Array],
                             h0: Optional[tuple[jax.Array, jax.Array]] = None, *,
                             options: ScanOptions, reverse: bool = False):
  """Complex scan on (real, imaginary) planes; see `engine.linear_scan_pairs`."""
  if x[0].dtype != x[1].dtype:
    raise ValueError(f"linear_scan_pairs: x's real and imaginary parts differ in dtype "
                     f"({x[0].dtype} vs {x[1].dtype}); cast them to one dtype.")
  return _run(tuple(a), tuple(x), None if h0 is None else tuple(h0), reverse, options)
