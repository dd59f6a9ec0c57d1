"""Pallas kernel bodies of the linear scan: forward, chunk summary and fused backward.

Each kernel sees one time chunk of one batch row and one channel block, in one of
two layouts (`pallas_scan` picks the view):
- rows (chunked launches, GPU): [C, rows, 128], time on the leading (untiled) axis. A
  step reads and writes `ref[t]`, one [rows, 128] tile at a dynamic time index: a
  plain address offset for Triton and Mosaic GPU.
- tiles (sequential launches, TPU): [C/8, rows, 8, 128], XLA:TPU's own (8, 128)
  tiling of [B, T, D]. A loop iteration loads tile g of every row ([rows, 8, 128]),
  runs its 8 steps on [rows, 128] slices taken statically in registers, and stores the
  8 results as one tile: every load and store is whole and aligned (Mosaic proves no
  unaligned sublane offset for 16-bit types), and no relayout is needed outside.
The state lives in float32 registers.

A value is a tuple of components, (v,) for real and (re, im) for complex scans, so
one body serves both; complex products are spelled out on real/imaginary parts.

Recurrences (s = scan order, "prev" = the previous step in scan order):
  forward   h_t = a_t h_prev + x_t
  backward  g_t = dy_t + c_t,  dx_t = g_t,  da_t = g_t conj(h_prev_t),
            c_{t-1} = conj(a_t) g_t          (c runs against scan order)
so the carry of a whole chunk is affine: out = P * in + L, with P the product of the
(conjugated) decays and L the chunk's result from a zero carry. For complex scans
these are the gradients of the real and imaginary planes; JAX's complex cotangent
convention follows from autodiff of the plane split in `pallas_scan`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Value = tuple[jax.Array, ...]


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Static shape of one kernel launch.

  Attributes:
    chunk: time steps C per block.
    rows: 128-lane rows per channel block (the block holds 128 * rows channels).
    num_chunks: time blocks in the (padded) sequence.
    components: 1 for real, 2 for complex (real/imaginary planes).
    reverse: the forward scan runs from the last step to the first.
    sequential: the state is carried across time blocks in scratch (TPU), instead
      of coming in as a per-chunk start state (GPU reduce-then-scan).
  """
  chunk: int
  rows: int
  num_chunks: int
  components: int
  reverse: bool
  sequential: bool


def complex_mul(a: Value, b: Value) -> Value:
  """a * b for values of one (real) or two (real, imaginary) components."""
  if len(a) == 1:
    return (a[0] * b[0],)
  return (a[0] * b[0] - a[1] * b[1], a[0] * b[1] + a[1] * b[0])


def complex_conj(a: Value) -> Value:
  """The conjugate (the value itself when real)."""
  return a if len(a) == 1 else (a[0], -a[1])


def complex_add(a: Value, b: Value) -> Value:
  """a + b, component-wise."""
  return tuple(u + v for u, v in zip(a, b))


def _load(refs: Sequence, t) -> Value:
  """Step t of a [C, rows, 128] block (any dtype) as float32 [rows, 128] tiles."""
  return tuple(r[t].astype(jnp.float32) for r in refs)


def _read(refs: Sequence) -> Value:
  """A whole [rows, 128] state block as float32."""
  return tuple(r[...].astype(jnp.float32) for r in refs)


def _store(refs: Sequence, t, value: Value) -> None:
  for ref, v in zip(refs, value):
    ref[t] = v.astype(ref.dtype)


def _write(refs: Sequence, value: Value) -> None:
  for ref, v in zip(refs, value):
    ref[...] = v.astype(ref.dtype)


def _step_index(i, tiling: Tiling, ascending: bool):
  """Time index of the i-th step of a sweep over a chunk."""
  return i if ascending else tiling.chunk - 1 - i


def forward_rows(a_refs, x_refs, h_refs, h: Value, tiling: Tiling) -> Value:
  """Scans one chunk from state `h`, storing every state; returns the final state."""
  ascending = not tiling.reverse

  def body(i, h):
    t = _step_index(i, tiling, ascending)
    h = complex_add(complex_mul(_load(a_refs, t), h), _load(x_refs, t))
    _store(h_refs, t, h)
    return h

  return jax.lax.fori_loop(0, tiling.chunk, body, h)


def summary_rows(a_refs, x_refs, tiling: Tiling, backward: bool) -> tuple[Value, Value]:
  """(decay product P, result L from a zero state) of one chunk.

  Forward steps are h <- a h + x in scan order; backward steps are the carry
  c <- conj(a) (x + c) against scan order. The first step is peeled (from a zero
  state it is exactly x, or conj(a) x, and P starts as that step's decay) so the
  loop carry starts from loaded values: Mosaic GPU needs a loop carry's register
  layout to match on entry and exit, and a constant has a different one.
  """
  ascending = tiling.reverse if backward else not tiling.reverse

  def decay(t) -> Value:
    a = _load(a_refs, t)
    return complex_conj(a) if backward else a

  def step(t, local: Value) -> Value:
    a, x = decay(t), _load(x_refs, t)
    if backward:
      return complex_mul(a, complex_add(x, local))
    return complex_add(complex_mul(a, local), x)

  first = _step_index(0, tiling, ascending)
  prod = decay(first)
  local = complex_mul(prod, _load(x_refs, first)) if backward else _load(x_refs, first)

  def body(i, carry):
    local, prod = carry
    t = _step_index(i, tiling, ascending)
    return step(t, local), complex_mul(decay(t), prod)

  local, prod = jax.lax.fori_loop(1, tiling.chunk, body, (local, prod))
  return prod, local


def backward_rows(a_refs, dy_refs, h_refs, edge: Value, dx_refs, da_refs, c: Value,
                  tiling: Tiling) -> Value:
  """Fused backward over one chunk: reads dy, a, h once, writes dx and da.

  `edge` is the state before the chunk's first step in scan order (h0 or the last
  state of the neighbouring chunk); `c` is the carry entering from the chunk after.
  The sweep runs against scan order, so the chunk's first step in scan order comes
  last; it is peeled off the loop because its previous state is `edge`, not a row
  of `h_refs`. Returns the carry leaving the chunk.
  """
  scan_ascending = not tiling.reverse
  prev_offset = -1 if scan_ascending else 1

  def step(t, h_prev: Value, c: Value) -> Value:
    g = complex_add(_load(dy_refs, t), c)
    _store(dx_refs, t, g)
    _store(da_refs, t, complex_mul(g, complex_conj(h_prev)))
    return complex_mul(complex_conj(_load(a_refs, t)), g)

  def body(i, c):
    t = _step_index(i, tiling, not scan_ascending)
    return step(t, _load(h_refs, t + prev_offset), c)

  c = jax.lax.fori_loop(0, tiling.chunk - 1, body, c)
  return step(_step_index(tiling.chunk - 1, tiling, not scan_ascending), edge, c)


# Time steps per tile of XLA:TPU's (8, 128) tiling of a [B, T, D] array.
SUBLANES = 8


def _load_tile(refs: Sequence, g) -> Value:
  """Tile g of a [C/8, rows, 8, 128] block: 8 time steps as float32 [rows, 8, 128]."""
  return tuple(r[g].astype(jnp.float32) for r in refs)


def _step_of(tile: Value, i: int) -> Value:
  """Time step i (static) of a loaded tile, [rows, 128]."""
  return tuple(v[:, i, :] for v in tile)


def _store_tile(refs: Sequence, g, steps: Sequence[Value]) -> None:
  """Writes 8 steps' [rows, 128] values as tile g."""
  for c, ref in enumerate(refs):
    ref[g] = jnp.stack([step[c] for step in steps], axis=1).astype(ref.dtype)


def _tile_steps(ascending: bool) -> range:
  return range(SUBLANES) if ascending else range(SUBLANES - 1, -1, -1)


def forward_tiles(a_refs, x_refs, h_refs, h: Value, tiling: Tiling) -> Value:
  """`forward_rows` on blocks in [B, T, D]'s own TPU tiling ([C/8, rows, 8, 128]: 8
  time steps of a channel row per tile). A tile is loaded whole and its 8 steps are
  taken apart statically, so no load or store starts at an unaligned sublane (Mosaic
  refuses those for 16-bit types) and XLA needs no relayout copy around the kernel."""
  ascending = not tiling.reverse
  tiles = tiling.chunk // SUBLANES

  def body(j, h):
    g = j if ascending else tiles - 1 - j
    a, x = _load_tile(a_refs, g), _load_tile(x_refs, g)
    steps = [None] * SUBLANES
    for i in _tile_steps(ascending):
      h = complex_add(complex_mul(_step_of(a, i), h), _step_of(x, i))
      steps[i] = h
    _store_tile(h_refs, g, steps)
    return h

  return jax.lax.fori_loop(0, tiles, body, h)


def backward_tiles(a_refs, dy_refs, h_refs, edge: Value, dx_refs, da_refs, c: Value,
                   tiling: Tiling) -> Value:
  """`backward_rows` on [C/8, rows, 8, 128] blocks (see `forward_tiles`).

  The sweep runs against scan order, a tile at a time. A step's previous state in scan
  order is the neighbouring step of its tile, or, for the tile's first step in scan
  order, the boundary step of the tile before it (loaded for that one row), or `edge`
  for the chunk's very first step: that tile is peeled off the loop.
  """
  scan_ascending = not tiling.reverse
  tiles = tiling.chunk // SUBLANES
  prev = -1 if scan_ascending else 1
  boundary = SUBLANES - 1 if scan_ascending else 0

  def sweep_tile(g, before: Value, c: Value) -> Value:
    a, dy, h = (_load_tile(refs, g) for refs in (a_refs, dy_refs, h_refs))
    dx_steps, da_steps = [None] * SUBLANES, [None] * SUBLANES
    for i in _tile_steps(not scan_ascending):
      h_prev = _step_of(h, i + prev) if 0 <= i + prev < SUBLANES else before
      g_i = complex_add(_step_of(dy, i), c)
      dx_steps[i] = g_i
      da_steps[i] = complex_mul(g_i, complex_conj(h_prev))
      c = complex_mul(complex_conj(_step_of(a, i)), g_i)
    _store_tile(dx_refs, g, dx_steps)
    _store_tile(da_refs, g, da_steps)
    return c

  def body(j, c):
    g = tiles - 1 - j if scan_ascending else j
    return sweep_tile(g, _step_of(_load_tile(h_refs, g + prev), boundary), c)

  c = jax.lax.fori_loop(0, tiles - 1, body, c)
  return sweep_tile(0 if scan_ascending else tiles - 1, edge, c)


def _mul_flops(n: int) -> int:
  """`complex_mul`: one product, or four products and two sums."""
  return 1 if n == 1 else 6


def _conj_flops(n: int) -> int:
  """`complex_conj`: nothing, or one negation."""
  return 0 if n == 1 else 1


def flops_per_lane(kernel: str, tiling: Tiling) -> int:
  """Float operations one program of `kernel` spends per channel lane of its block.

  Counted from the bodies above (index arithmetic is integer and not counted), so XLA's
  cost model and scheduler see the kernels' real arithmetic instead of an opaque call;
  tests/test_scan_pallas.py checks each figure against a count of the traced kernel.
  `kernel` is "forward", "summary", "summary_backward" or "backward".
  """
  n, c = tiling.components, tiling.chunk
  mul, conj = _mul_flops(n), _conj_flops(n)
  if kernel == "forward":
    return c * (mul + n)
  if kernel == "summary":
    return (c - 1) * (2 * mul + n)
  if kernel == "summary_backward":
    return (c - 1) * (2 * mul + n + 2 * conj) + mul + conj
  if kernel == "backward":
    # A chunked launch drops the carry leaving the chunk (its last conj(a) g).
    return c * (n + 2 * mul + 2 * conj) - (0 if tiling.sequential else mul + conj)
  raise ValueError(f"unknown scan kernel {kernel!r}")


def _split(refs: Sequence, n: int, *counts: int) -> list[Sequence]:
  out, pos = [], 0
  for count in counts:
    out.append(refs[pos:pos + count * n])
    pos += count * n
  return out


def forward_kernel(*refs, tiling: Tiling):
  """h for one chunk. Refs: a, x, init | h, (last) | (state scratch).

  Sequential: `init` is h0 [rows, 128], the state lives in scratch across time
  blocks and `last` receives the final state. Chunked: `init` is this chunk's true
  start state from the scan over chunk summaries.
  """
  n = tiling.components
  if tiling.sequential:
    a_refs, x_refs, init_refs, h_refs, last_refs, state_refs = _split(
        refs, n, 1, 1, 1, 1, 1, 1)
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
      _write(state_refs, _read(init_refs))

    h = forward_tiles(a_refs, x_refs, h_refs, _read(state_refs), tiling)
    _write(state_refs, h)

    @pl.when(k == tiling.num_chunks - 1)
    def _():
      _write(last_refs, h)
  else:
    a_refs, x_refs, init_refs, h_refs = _split(refs, n, 1, 1, 1, 1)
    forward_rows(a_refs, x_refs, h_refs, _read(init_refs), tiling)


def summary_kernel(*refs, tiling: Tiling, backward: bool):
  """Chunk summary for reduce-then-scan (see `summary_rows`). Refs: a, x | P, L."""
  a_refs, x_refs, p_refs, l_refs = _split(refs, tiling.components, 1, 1, 1, 1)
  prod, local = summary_rows(a_refs, x_refs, tiling, backward)
  _write(p_refs, prod)
  _write(l_refs, local)


def backward_kernel(*refs, tiling: Tiling):
  """Fused backward for one chunk. Refs: a, dy, h, edge, init | dx, da, (dh0) |
  (carry scratch). `init` is the carry entering the chunk: the cotangent of the last
  state (sequential, at the first grid step) or the chunk's true carry (chunked)."""
  n = tiling.components
  if tiling.sequential:
    (a_refs, dy_refs, h_refs, edge_refs, init_refs, dx_refs, da_refs, dh0_refs,
     carry_refs) = _split(refs, n, 1, 1, 1, 1, 1, 1, 1, 1, 1)
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
      _write(carry_refs, _read(init_refs))

    c = _read(carry_refs)
  else:
    a_refs, dy_refs, h_refs, edge_refs, init_refs, dx_refs, da_refs = _split(
        refs, n, 1, 1, 1, 1, 1, 1, 1)
    c = _read(init_refs)
  sweep = backward_tiles if tiling.sequential else backward_rows
  c = sweep(a_refs, dy_refs, h_refs, _read(edge_refs), dx_refs, da_refs, c, tiling)
  if tiling.sequential:
    _write(carry_refs, c)

    @pl.when(k == tiling.num_chunks - 1)
    def _():
      _write(dh0_refs, c)
