"""Pallas kernel bodies of the linear scan: forward, chunk summary and fused backward.

Each kernel sees one time chunk of one batch row and one channel block, laid out as
[C, rows, 128]: time on the leading (untiled) axis, the channel block as `rows`
sublanes of 128 lanes. A step reads and writes `ref[t]`, one [rows, 128] tile, so
the time index is a dynamic index on an untiled axis: a plain address offset for
Mosaic TPU, Triton and Mosaic GPU alike. Nothing slices or concatenates rows inside
a tile, which Mosaic's (8, 128) vector layouts do not support in general. The state
lives in float32 registers.

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

    h = forward_rows(a_refs, x_refs, h_refs, _read(state_refs), tiling)
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
  c = backward_rows(a_refs, dy_refs, h_refs, _read(edge_refs), dx_refs, da_refs, c,
                    tiling)
  if tiling.sequential:
    _write(carry_refs, c)

    @pl.when(k == tiling.num_chunks - 1)
    def _():
      _write(dh0_refs, c)
