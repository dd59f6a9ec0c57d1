"""RMSNorm: y = x / sqrt(mean(x²) + eps) · (1 + scale).

The scale is stored as an offset from 1 and initialised to 0, so a fresh norm is the
identity on the unit sphere and weight decay pulls it towards that identity. The
statistics are always taken in float32 (a bf16 mean of squares loses the small
channels), and the result is returned in the compute dtype.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import partitioning as P


class RMSNorm(nn.Module):
  """Root-mean-square normalisation over the last axis with a learned (1 + scale).

  Attributes:
    dtype: dtype of the output.
    eps: added to the mean square before the reciprocal square root.
  """
  dtype: Any = jnp.float32
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = P.logical_param(self, "scale", nn.initializers.zeros_init(), (x.shape[-1],),
                            (P.NORM,))
    x = x.astype(jnp.float32)
    mean_square = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    y = x * jax.lax.rsqrt(mean_square + self.eps) * (scale + 1)
    return y.astype(self.dtype)
