"""Single-pass GPU linear scan: time chunks in parallel, chained by decoupled look-back.

Why: the "chunked" strategy (reduce then scan) reads a and x twice, so its forward
moves 14 bytes per element for bf16 x (20 for float32) where 8 (12) are needed: at
best 57% (60%) of copy bandwidth. Here every (batch row, channel block, time chunk)
is still its own program, so the GPU is full even at B = 1, but a program gets its
chunk's start state from its predecessors while they run (Merrill & Garland's
decoupled look-back), and a, x are read once and h written once.

One program:
1. Takes a ticket from an atomic counter. Tickets follow the order programs start,
   so every program a ticket waits on has already started: no deadlock, whatever
   order the GPU schedules programs in. Ticket -> (sweep position p, lane), with
   lane = (batch row, channel block) varying fastest, so the chunk a program waits
   for started a whole row of lanes earlier.
2. Loads its C steps into registers, all at once (C independent loads in flight per
   thread instead of one memory round trip per step), and reduces them to the
   chunk's affine map s -> P s + L (P: product of decays, L: result from s = 0).
3. Publishes (P, L) with flag 1, then looks back: it composes the maps of chunks
   p-1, p-2, ... until one has published its inclusive state (flag 2), or it
   reaches the sequence start (h0). Publishes its own inclusive state, flag 2.
4. Re-scans the chunk from registers and writes every state.

The backward is the same sweep against scan order, on the carry c <- conj(a)(dy + c),
writing dx = dy + c and da = (dy + c) conj(h_prev) as it goes: it reads dy, a and
h once (h_prev of a chunk's first step is the neighbouring chunk's row of h, or h0).

Memory ordering: a program stores its (P, L) or inclusive state, syncs its threads,
then raises the flag with an atomic (Triton's atomics are acquire-release at GPU
scope, and a scalar atomic runs once per program); readers see the flag through an
atomic and then read the state with volatile loads (past the non-coherent L1). Flags
only rise (0 -> 1 -> 2), set with atomic max.

Backends: Pallas Triton on GPU, and interpret mode (CPU tests: programs run one
after another in ticket order, so a look-back always finds its predecessor done; the
aggregate-composing path is tested separately on hand-made flags). TPU has no
cross-core atomics in Pallas and Mosaic GPU's pallas_call has no atomic read here.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from model.scan.pallas_kernels import Tiling
from model.scan.pallas_kernels import Value
from model.scan.pallas_kernels import complex_add
from model.scan.pallas_kernels import complex_conj
from model.scan.pallas_kernels import complex_mul

_F32 = jnp.float32
_LANES = 128
_AGGREGATE, _INCLUSIVE = 1, 2

# A look-back program keeps its chunk (two float32 values per step and component)
# in registers; 32 steps is 64 registers per thread for a real scan on a one-row
# block, leaving room for the rest under Triton's 255-register limit.
MAX_CHUNK = 32


@dataclasses.dataclass(frozen=True)
class Grid:
  """Static shape of a look-back launch: `tiling`, how lanes are numbered, and
  whether it runs in interpret mode (one program at a time, no threads to sync)."""
  tiling: Tiling
  batch: int
  row_blocks: int
  interpret: bool = False

  @property
  def lanes(self) -> int:
    return self.batch * self.row_blocks

  @property
  def programs(self) -> int:
    return self.lanes * self.tiling.num_chunks


@dataclasses.dataclass(frozen=True)
class _Program:
  """Where one program works, decoded from its ticket."""
  position: jax.Array      # sweep position of its chunk
  lane: jax.Array
  batch: jax.Array
  rows: pl.Slice           # its channel rows
  first_step: jax.Array    # time index of the chunk's first step (in array order)


def _claim(counter_ref, grid: Grid, sweep_ascending: bool) -> _Program:
  zero = pl.program_id(0) * 0
  ticket = pltriton.atomic_add(counter_ref, zero, zero + 1)
  position, lane = ticket // grid.lanes, ticket % grid.lanes
  chunk = position if sweep_ascending else grid.tiling.num_chunks - 1 - position
  rows = pl.ds((lane % grid.row_blocks) * grid.tiling.rows, grid.tiling.rows)
  return _Program(position, lane, lane // grid.row_blocks, rows,
                  chunk * grid.tiling.chunk)


def _steps(grid: Grid, sweep_ascending: bool) -> list[int]:
  """Offsets of the chunk's steps inside the chunk, in sweep order."""
  steps = list(range(grid.tiling.chunk))
  return steps if sweep_ascending else steps[::-1]


def _row(refs: Sequence, program: _Program, t) -> Value:
  return tuple(r[program.batch, t, program.rows, :].astype(_F32) for r in refs)


def _put_row(refs: Sequence, program: _Program, t, value: Value) -> None:
  for ref, v in zip(refs, value):
    ref[program.batch, t, program.rows, :] = v.astype(ref.dtype)


def _state(refs: Sequence, program: _Program) -> Value:
  return tuple(r[program.batch, program.rows, :].astype(_F32) for r in refs)


def _put_state(refs: Sequence, program: _Program, value: Value) -> None:
  for ref, v in zip(refs, value):
    ref[program.batch, program.rows, :] = v.astype(ref.dtype)


def _publish(flags_ref, grid: Grid, lane, position, flag: int, *stores) -> None:
  """Stores per-chunk states ((refs, value) pairs), then raises the chunk's flag; the
  atomic orders the stores before the flag for every reader."""
  for refs, value in stores:
    for ref, v in zip(refs, value):
      ref[lane, position] = v
  # Every thread stored part of the state; one thread raises the flag (Triton runs
  # a scalar atomic once per program), so the block syncs first and the release is
  # cumulative over all the stores.
  if not grid.interpret:
    pltriton.debug_barrier()
  index = lane * grid.tiling.num_chunks + position
  pltriton.atomic_max(flags_ref, index, index * 0 + flag)


def _volatile(refs: Sequence, lane, position) -> Value:
  return tuple(pltriton.load(r.at[lane, position], volatile=True) for r in refs)


def look_back(flags_ref, prod_refs, local_refs, inclusive_refs, grid: Grid, lane,
              position, base: Value) -> Value:
  """The start state of chunk `position` of `lane`.

  Walks back from the previous chunk, composing published chunk maps (flag 1)
  until a chunk's inclusive state (flag 2) or the sequence start (`base`, for
  position 0); spins while the chunk it needs has published nothing yet.
  Composition: with the maps of chunks p-1 ... j+1 composed into s -> A s + B,
  adding chunk j's (P, L) gives A P s + (A L + B); chunk j's inclusive state I ends
  the walk at A I + B.
  """
  zeros = tuple(jnp.zeros_like(v) for v in base)
  identity = (jnp.ones_like(base[0]),) + zeros[1:]    # 1, or 1 + 0i

  def walking(carry):
    return jnp.logical_not(carry[4])

  def step(carry):
    prod, local, start, j, _ = carry
    flag = pltriton.atomic_add(flags_ref, lane * grid.tiling.num_chunks + j, j * 0)
    p_j, l_j = _volatile(prod_refs, lane, j), _volatile(local_refs, lane, j)
    inclusive = _volatile(inclusive_refs, lane, j)
    composed_prod = complex_mul(prod, p_j)
    composed_local = complex_add(complex_mul(prod, l_j), local)
    use_inclusive = flag == _INCLUSIVE
    use_aggregate = flag == _AGGREGATE
    previous = jnp.where(use_aggregate, j - 1, j)
    at_start = jnp.logical_and(use_aggregate, previous < 0)
    pick = lambda cond, new, old: tuple(jnp.where(cond, n, o) for n, o in zip(new, old))
    start = pick(use_inclusive, complex_add(complex_mul(prod, inclusive), local), start)
    from_base = complex_add(complex_mul(composed_prod, base), composed_local)
    start = pick(at_start, from_base, start)
    return (pick(use_aggregate, composed_prod, prod),
            pick(use_aggregate, composed_local, local), start,
            previous, jnp.logical_or(use_inclusive, at_start))

  # The tensors lead the carry: Triton's layout propagation through scf.while
  # (RemoveLayoutConversions) reads the loop's results at the index of the
  # yielded value, and a tensor placed after the scalar done-flag falls past the
  # end of them, which segfaulted XLA:GPU's Triton compile of this kernel
  # (tests/test_gpu_compile.py keeps the look-back kernels compiling).
  carry = (identity, zeros, base, position - 1, position == 0)
  return jax.lax.while_loop(walking, step, carry)[2]


def _chain(workspace: Sequence, grid: Grid, program: _Program, prod: Value,
           local: Value, base: Value) -> tuple[Value, Value]:
  """Publishes this chunk's map, looks back, publishes its inclusive state.
  Returns (start state, inclusive state)."""
  flags_ref, prod_refs, local_refs, inclusive_refs = workspace
  _publish(flags_ref, grid, program.lane, program.position, _AGGREGATE,
           (prod_refs, prod), (local_refs, local))
  start = look_back(flags_ref, prod_refs, local_refs, inclusive_refs, grid,
                    program.lane, program.position, base)
  inclusive = complex_add(complex_mul(prod, start), local)
  _publish(flags_ref, grid, program.lane, program.position, _INCLUSIVE,
           (inclusive_refs, inclusive))
  return start, inclusive


def _groups(refs: Sequence, n: int, *counts: int) -> list:
  """Splits a kernel's flat refs: a count of 0 is one single ref (flags, counter),
  any other count is that many component tuples of n refs."""
  out, pos = [], 0
  for count in counts:
    if count == 0:
      out.append(refs[pos])
      pos += 1
    else:
      out.extend(tuple(refs[pos + i * n:pos + (i + 1) * n]) for i in range(count))
      pos += count * n
  return out


def _reduce(decays: Sequence[Value], inputs: Sequence[Value]) -> tuple[Value, Value]:
  """The map s -> P s + L of steps s <- d s + u (in the given order)."""
  prod, local = decays[0], inputs[0]
  for d, u in zip(decays[1:], inputs[1:]):
    prod, local = complex_mul(d, prod), complex_add(complex_mul(d, local), u)
  return prod, local


def forward_kernel(*refs, grid: Grid):
  """Refs: a, x, h0, (flags, counter in) | h, last, P, L, inclusive, flags, counter."""
  (a_refs, x_refs, h0_refs, _, _, h_refs, last_refs, prod_refs, local_refs,
   inclusive_refs, flags_ref, counter_ref) = _groups(
       refs, grid.tiling.components, 3, 0, 0, 5, 0, 0)
  ascending = not grid.tiling.reverse
  program = _claim(counter_ref, grid, ascending)
  times = [program.first_step + s for s in _steps(grid, ascending)]
  decays = [_row(a_refs, program, t) for t in times]
  inputs = [_row(x_refs, program, t) for t in times]
  prod, local = _reduce(decays, inputs)
  h, inclusive = _chain((flags_ref, prod_refs, local_refs, inclusive_refs), grid,
                        program, prod, local, _state(h0_refs, program))
  for t, d, u in zip(times, decays, inputs):
    h = complex_add(complex_mul(d, h), u)
    _put_row(h_refs, program, t, h)

  @pl.when(program.position == grid.tiling.num_chunks - 1)
  def _():
    _put_state(last_refs, program, inclusive)


def backward_kernel(*refs, grid: Grid):
  """Refs: a, dy, h, h0, dlast, (flags, counter in) | dx, da, dh0, P, L, inclusive,
  flags, counter. The sweep runs against scan order on c <- conj(a) (dy + c)."""
  (a_refs, dy_refs, h_refs, h0_refs, dlast_refs, _, _, dx_refs, da_refs, dh0_refs,
   prod_refs, local_refs, inclusive_refs, flags_ref, counter_ref) = _groups(
       refs, grid.tiling.components, 5, 0, 0, 6, 0, 0)
  scan_ascending = not grid.tiling.reverse
  program = _claim(counter_ref, grid, not scan_ascending)
  times = [program.first_step + s for s in _steps(grid, not scan_ascending)]
  decays = [complex_conj(_row(a_refs, program, t)) for t in times]
  grads = [_row(dy_refs, program, t) for t in times]
  prod, local = _reduce(decays, [complex_mul(d, g) for d, g in zip(decays, grads)])
  carry, inclusive = _chain((flags_ref, prod_refs, local_refs, inclusive_refs), grid,
                            program, prod, local, _state(dlast_refs, program))
  h0 = _state(h0_refs, program)
  padded_time = grid.tiling.num_chunks * grid.tiling.chunk
  offset = -1 if scan_ascending else 1
  for i, (t, d, dy) in enumerate(zip(times, decays, grads)):
    g = complex_add(dy, carry)
    _put_row(dx_refs, program, t, g)
    previous = t + offset
    if i == len(times) - 1:
      # The chunk's first step in scan order: its previous state is the neighbouring
      # chunk's last row, or h0 at the sequence start.
      inside = jnp.logical_and(previous >= 0, previous < padded_time)
      row = _row(h_refs, program, jnp.clip(previous, 0, padded_time - 1))
      h_prev = tuple(jnp.where(inside, r, s) for r, s in zip(row, h0))
    else:
      h_prev = _row(h_refs, program, previous)
    _put_row(da_refs, program, t, complex_mul(g, complex_conj(h_prev)))
    carry = complex_mul(d, g)

  @pl.when(program.position == grid.tiling.num_chunks - 1)
  def _():
    _put_state(dh0_refs, program, inclusive)


def _workspace(grid: Grid) -> list[jax.ShapeDtypeStruct]:
  """P, L and inclusive state per (lane, chunk) and component, then flags, counter."""
  state = jax.ShapeDtypeStruct(
      (grid.lanes, grid.tiling.num_chunks, grid.tiling.rows, _LANES), _F32)
  return [state] * 3 * grid.tiling.components + [
      jax.ShapeDtypeStruct((grid.programs,), jnp.int32),
      jax.ShapeDtypeStruct((1,), jnp.int32)]


def _launch(kernel, grid: Grid, args: Sequence[jax.Array], out_shape: list,
            compiler_params) -> list[jax.Array]:
  """Runs `kernel` once per ticket on whole-array refs; the zeroed flags and counter
  go in last and come back (aliased) as the last two outputs."""
  out_shape = out_shape + _workspace(grid)
  zeros = [jnp.zeros((grid.programs,), jnp.int32), jnp.zeros((1,), jnp.int32)]
  n_in, n_out = len(args) + 2, len(out_shape)
  outs = pl.pallas_call(
      functools.partial(kernel, grid=grid), grid=(grid.programs,),
      out_shape=out_shape, input_output_aliases={n_in - 2: n_out - 2,
                                                 n_in - 1: n_out - 1},
      interpret=grid.interpret, compiler_params=compiler_params)(*args, *zeros)
  return outs


def forward(grid: Grid, a: Value, x: Value, h0: Value, *,
            compiler_params) -> tuple[Value, Value]:
  """a, x: component tuples [B, Tp, R, 128]; h0: [B, R, 128]. Returns (h, last)."""
  n = grid.tiling.components
  h_shape = jax.ShapeDtypeStruct(x[0].shape, x[0].dtype)
  last_shape = jax.ShapeDtypeStruct(h0[0].shape, _F32)
  outs = _launch(forward_kernel, grid, [*a, *x, *h0], [h_shape] * n + [last_shape] * n,
                 compiler_params)
  return tuple(outs[:n]), tuple(outs[n:2 * n])


def backward(grid: Grid, a: Value, h: Value, h0: Value, dy: Value, dlast: Value, *,
             compiler_params) -> tuple[Value, Value, Value]:
  """Cotangents (da, dx, dh0) of `forward`'s (h, last)."""
  n = grid.tiling.components
  dx_shape = jax.ShapeDtypeStruct(dy[0].shape, dy[0].dtype)
  da_shape = jax.ShapeDtypeStruct(dy[0].shape, _F32)
  dh0_shape = jax.ShapeDtypeStruct(h0[0].shape, _F32)
  outs = _launch(backward_kernel, grid, [*a, *dy, *h, *h0, *dlast],
                 [dx_shape] * n + [da_shape] * n + [dh0_shape] * n, compiler_params)
  return tuple(outs[n:2 * n]), tuple(outs[:n]), tuple(outs[2 * n:3 * n])
