"""Dispatch for `linear_scan` (placeholder lax.scan engine; extended by the scan work)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def linear_scan(a: jax.Array, x: jax.Array, h0: jax.Array | None = None, *,
                reverse: bool = False, impl: str = "auto") -> tuple[jax.Array, jax.Array]:
  """Returns (h [B,T,D], h_last [B,D]) for h_t = a_t * h_{t-1} + x_t."""
  del impl
  acc_dtype = jnp.complex64 if jnp.iscomplexobj(x) or jnp.iscomplexobj(a) else jnp.float32
  if h0 is None:
    h0 = jnp.zeros((x.shape[0], x.shape[2]), acc_dtype)

  def step(h, ax):
    a_t, x_t = ax
    h = a_t.astype(acc_dtype) * h + x_t.astype(acc_dtype)
    return h, h

  h_last, hs = jax.lax.scan(step, h0.astype(acc_dtype),
                            (jnp.swapaxes(a, 0, 1), jnp.swapaxes(x, 0, 1)),
                            reverse=reverse)
  return jnp.swapaxes(hs, 0, 1).astype(x.dtype), h_last
