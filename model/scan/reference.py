"""A float64 NumPy linear scan and its VJP: the ground truth the scan tests compare to.

Written as the plainest possible loops, independent of JAX's autodiff, so a wrong
custom VJP cannot agree with it by construction.
"""
from __future__ import annotations

from typing import Optional

import numpy as np


def _wide(v):
  v = np.asarray(v)
  return v.astype(np.complex128 if np.iscomplexobj(v) else np.float64)


def scan(a, x, h0: Optional[np.ndarray] = None, reverse: bool = False):
  """Returns (h [B,T,D], h_last [B,D]) of h_t = a_t h_prev + x_t in float64/complex128."""
  a, x = _wide(a), _wide(x)
  dtype = np.result_type(a, x)
  h = np.zeros(x.shape, dtype)
  state = np.zeros((x.shape[0], x.shape[2]), dtype) if h0 is None else _wide(h0).astype(dtype)
  steps = range(x.shape[1] - 1, -1, -1) if reverse else range(x.shape[1])
  for t in steps:
    state = a[:, t] * state + x[:, t]
    h[:, t] = state
  return h, state


def scan_vjp(a, x, h0, dh, dlast, reverse: bool = False):
  """Cotangents (da, dx, dh0) of `scan` for output cotangents (dh, dlast).

  Uses JAX's convention for complex numbers: a cotangent is pulled back through the
  transpose of the complex-linear map (no conjugation), e.g. d(a h)/da pulls w back to
  w h. (Gradients of real losses come out conjugated, as `jax.grad` documents.)
  """
  a, x = _wide(a), _wide(x)
  h0 = np.zeros((x.shape[0], x.shape[2]), np.result_type(a, x)) if h0 is None else _wide(h0)
  h, _ = scan(a, x, h0, reverse)
  dh, carry = _wide(dh), _wide(dlast)
  da, dx = np.zeros_like(h), np.zeros_like(h)
  steps = range(x.shape[1]) if reverse else range(x.shape[1] - 1, -1, -1)
  for t in steps:
    prev_t = t + 1 if reverse else t - 1
    h_prev = h0 if prev_t in (-1, x.shape[1]) else h[:, prev_t]
    g = dh[:, t] + carry
    dx[:, t] = g
    da[:, t] = g * h_prev
    carry = a[:, t] * g
  return da, dx, carry
