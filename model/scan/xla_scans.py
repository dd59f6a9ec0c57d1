"""The scans XLA builds from `jax.lax`: sequential (`lax.scan`) and parallel prefix
(`lax.associative_scan`), with the shared input checks and accumulation dtype. The
dispatcher (`engine`), the Pallas kernels (their cross-chunk carry) and the
sequence-parallel scan use them."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


def accumulation_dtype(a: jax.Array, x: jax.Array) -> jnp.dtype:
  """float32, or complex64 when either operand is complex."""
  if jnp.iscomplexobj(a) or jnp.iscomplexobj(x):
    return jnp.dtype(jnp.complex64)
  return jnp.dtype(jnp.float32)


def validate(a: jax.Array, x: jax.Array, h0: Optional[jax.Array]) -> None:
  if x.ndim != 3:
    raise ValueError(f"linear_scan: x must be [batch, time, channels], got shape "
                     f"{x.shape}.")
  if a.shape != x.shape:
    raise ValueError(f"linear_scan: a has shape {a.shape} but x has {x.shape}; "
                     "broadcast the decay to x's shape first.")
  if h0 is not None and h0.shape != (x.shape[0], x.shape[2]):
    raise ValueError(f"linear_scan: h0 must be [batch, channels] = "
                     f"{(x.shape[0], x.shape[2])}, got {h0.shape}.")


def lax_linear_scan(a, x, h0, reverse, unroll, acc):
  """Sequential scan; vmapped over batch so time is sliced in place (no transposes)."""

  def one_row(a_row, x_row, h_init):

    def step(h, ax):
      a_t, x_t = ax
      h = a_t.astype(acc) * h + x_t.astype(acc)
      return h, h

    return jax.lax.scan(step, h_init, (a_row, x_row), reverse=reverse, unroll=unroll)

  h_last, h = jax.vmap(one_row)(a, x, h0)
  return h, h_last


def associative_linear_scan(a, x, h0, reverse, acc):
  """Parallel prefix over (a, x) pairs; h0 is folded into the first step's input."""
  a = a.astype(acc)
  x = x.astype(acc)
  first = -1 if reverse else 0
  x = x.at[:, first].add(a[:, first] * h0)

  def combine(earlier, later):
    a_i, x_i = earlier
    a_j, x_j = later
    return a_j * a_i, a_j * x_i + x_j

  _, h = jax.lax.associative_scan(combine, (a, x), axis=1, reverse=reverse)
  return h, h[:, 0 if reverse else -1]
