"""Pallas kernel bodies of the linear scan: forward, chunk summary and fused backward.

Each kernel sees one time chunk [C, bd] of one batch row and one lane-dense channel
block, walks it in groups of G rows (G = 8 or 16 on TPU, where a group is one
sublane tile and rows are sliced statically inside it; G = 1 on GPU, where each row
is one pointer-offset load) and keeps the state in float32 registers.

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
    block: channels bd per block.
    group: rows G loaded and stored together.
    num_chunks: time blocks in the (padded) sequence.
    components: 1 for real, 2 for complex (real/imaginary planes).
    reverse: the forward scan runs from the last step to the first.
    sequential: the state is carried across time blocks in scratch (TPU), instead
      of coming in as a per-chunk start state (GPU reduce-then-scan).
  """
  chunk: int
  block: int
  group: int
  num_chunks: int
  components: int
  reverse: bool
  sequential: bool

  @property
  def num_groups(self) -> int:
    return self.chunk // self.group


def _mul(a: Value, b: Value) -> Value:
  if len(a) == 1:
    return (a[0] * b[0],)
  return (a[0] * b[0] - a[1] * b[1], a[0] * b[1] + a[1] * b[0])


def _conj(a: Value) -> Value:
  return a if len(a) == 1 else (a[0], -a[1])


def _add(a: Value, b: Value) -> Value:
  return tuple(u + v for u, v in zip(a, b))


def _load_group(refs: Sequence, start, group: int) -> Value:
  return tuple(r[pl.ds(start, group), :].astype(jnp.float32) for r in refs)


def _row(value: Value, r: int, group: int) -> Value:
  return value if group == 1 else tuple(v[r:r + 1] for v in value)


def _store_group(refs: Sequence, start, rows: list[Value], group: int) -> None:
  for c, ref in enumerate(refs):
    block = rows[0][c] if group == 1 else jnp.concatenate([row[c] for row in rows], 0)
    ref[pl.ds(start, group), :] = block.astype(ref.dtype)


def _group_start(i, tiling: Tiling, ascending: bool):
  g = i if ascending else tiling.num_groups - 1 - i
  return pl.multiple_of(g * tiling.group, tiling.group), g


def forward_rows(a_refs, x_refs, h_refs, h: Value, tiling: Tiling,
                 decay_product: bool = False, backward_carry: bool = False):
  """Scans one chunk from state `h`; stores every state when `h_refs` is given.

  With `backward_carry` the step is the backward carry c <- conj(a) (x + c) (used to
  summarise a chunk of the backward pass); `decay_product` also returns the product
  of the step's decays over the chunk. Returns the final state (and the product).
  """
  group = tiling.group
  ascending = not tiling.reverse if not backward_carry else tiling.reverse
  order = range(group) if ascending else range(group - 1, -1, -1)

  def body(i, carry):
    h, prod = carry if decay_product else (carry, None)
    start, _ = _group_start(i, tiling, ascending)
    a_blk = _load_group(a_refs, start, group)
    x_blk = _load_group(x_refs, start, group)
    rows = [None] * group
    for r in order:
      a_r = _row(a_blk, r, group)
      x_r = _row(x_blk, r, group)
      if backward_carry:
        a_r = _conj(a_r)
        h = _mul(a_r, _add(x_r, h))
      else:
        h = _add(_mul(a_r, h), x_r)
      if decay_product:
        prod = _mul(a_r, prod)
      rows[r] = h
    if h_refs is not None:
      _store_group(h_refs, start, rows, group)
    return (h, prod) if decay_product else h

  if not decay_product:
    return jax.lax.fori_loop(0, tiling.num_groups, body, h)
  identity = tuple(jnp.full_like(v, 1.0 if c == 0 else 0.0) for c, v in enumerate(h))
  return jax.lax.fori_loop(0, tiling.num_groups, body, (h, identity))


def backward_rows(a_refs, dy_refs, h_refs, edge: Value, dx_refs, da_refs, c: Value,
                  tiling: Tiling) -> Value:
  """Fused backward over one chunk: reads dy, a, h once, writes dx and da.

  `edge` is the state before the chunk's first step in scan order (h0 or the last
  state of the neighbouring chunk); `c` is the carry entering from the chunk after.
  Returns the carry leaving the chunk.
  """
  group, chunk = tiling.group, tiling.chunk
  scan_ascending = not tiling.reverse
  order = range(group - 1, -1, -1) if scan_ascending else range(group)

  def body(i, c):
    start, g = _group_start(i, tiling, not scan_ascending)
    a_blk = _load_group(a_refs, start, group)
    dy_blk = _load_group(dy_refs, start, group)
    h_blk = _load_group(h_refs, start, group)
    if scan_ascending:   # prev of row r is row r-1; row 0 needs the group before.
      neighbour = _load_group(h_refs, jnp.maximum(start - group, 0), group)
      outer = tuple(jnp.where(g == 0, e, _row(neighbour, group - 1, group)[k])
                    for k, e in enumerate(edge))
    else:                # prev of row r is row r+1; the last row needs the group after.
      neighbour = _load_group(h_refs, jnp.minimum(start + group, chunk - group), group)
      outer = tuple(jnp.where(g == tiling.num_groups - 1, e, _row(neighbour, 0, group)[k])
                    for k, e in enumerate(edge))
    dx_rows, da_rows = [None] * group, [None] * group
    for r in order:
      inner = r - 1 if scan_ascending else r + 1
      h_prev = outer if inner in (-1, group) else _row(h_blk, inner, group)
      g_r = _add(_row(dy_blk, r, group), c)
      dx_rows[r] = g_r
      da_rows[r] = _mul(g_r, _conj(h_prev))
      c = _mul(_conj(_row(a_blk, r, group)), g_r)
    _store_group(dx_refs, start, dx_rows, group)
    _store_group(da_refs, start, da_rows, group)
    return c

  return jax.lax.fori_loop(0, tiling.num_groups, body, c)


def _split(refs: Sequence, n: int, *counts: int) -> list[Sequence]:
  out, pos = [], 0
  for count in counts:
    out.append(refs[pos:pos + count * n])
    pos += count * n
  return out


def forward_kernel(*refs, tiling: Tiling):
  """h for one chunk. Refs: a, x, init | h, (last) | (state scratch).

  Sequential: `init` is h0 [1, bd], the state lives in scratch across time blocks
  and `last` receives the final state. Chunked: `init` is this chunk's true start
  state from the scan over chunk summaries.
  """
  n = tiling.components
  if tiling.sequential:
    a_refs, x_refs, init_refs, h_refs, last_refs, state_refs = _split(
        refs, n, 1, 1, 1, 1, 1, 1)
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
      for s, i in zip(state_refs, init_refs):
        s[...] = i[...].astype(jnp.float32)

    h = forward_rows(a_refs, x_refs, h_refs, tuple(s[...] for s in state_refs), tiling)
    for s, v in zip(state_refs, h):
      s[...] = v

    @pl.when(k == tiling.num_chunks - 1)
    def _():
      for last, v in zip(last_refs, h):
        last[...] = v
  else:
    a_refs, x_refs, init_refs, h_refs = _split(refs, n, 1, 1, 1, 1)
    forward_rows(a_refs, x_refs, h_refs,
                 tuple(i[...].astype(jnp.float32) for i in init_refs), tiling)


def summary_kernel(*refs, tiling: Tiling, backward: bool):
  """Chunk summary for reduce-then-scan: the decay product P and the result L of the
  chunk from a zero state (forward) or zero carry (backward). Refs: a, x | P, L."""
  n = tiling.components
  a_refs, x_refs, p_refs, l_refs = _split(refs, n, 1, 1, 1, 1)
  zero = tuple(jnp.zeros((1, tiling.block), jnp.float32) for _ in range(n))
  local, prod = forward_rows(a_refs, x_refs, None, zero, tiling, decay_product=True,
                             backward_carry=backward)
  for ref, v in zip(p_refs, prod):
    ref[...] = v
  for ref, v in zip(l_refs, local):
    ref[...] = v


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
      for s, i in zip(carry_refs, init_refs):
        s[...] = i[...].astype(jnp.float32)

    c = tuple(s[...] for s in carry_refs)
  else:
    a_refs, dy_refs, h_refs, edge_refs, init_refs, dx_refs, da_refs = _split(
        refs, n, 1, 1, 1, 1, 1, 1, 1)
    c = tuple(i[...].astype(jnp.float32) for i in init_refs)
  edge = tuple(e[...].astype(jnp.float32) for e in edge_refs)
  c = backward_rows(a_refs, dy_refs, h_refs, edge, dx_refs, da_refs, c, tiling)
  if tiling.sequential:
    for s, v in zip(carry_refs, c):
      s[...] = v

    @pl.when(k == tiling.num_chunks - 1)
    def _():
      for out, v in zip(dh0_refs, c):
        out[...] = v
