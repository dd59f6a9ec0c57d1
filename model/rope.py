"""Rotary position embedding (RoPE) on the first half of each head's channels.

For a head vector x of size H, the first H/2 channels are split into halves (u, v) of
size H/4 and rotated pairwise by angle p · ω_j, with p the token's position in its
document and ω_j = 10000^(-2j/(H/2)), j = 0..H/4-1:

    u' = u cos(pω) - v sin(pω),   v' = v cos(pω) + u sin(pω).

The second H/2 channels pass through unrotated (Griffin / RecurrentGemma): half of each
head is position-free. Positions restart at each document, so a document's attention
pattern does not depend on where it was packed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_WAVELENGTH = 10_000


def apply_rope(x: jax.Array, positions: jax.Array,
               max_wavelength: int = MAX_WAVELENGTH) -> jax.Array:
  """x [B, T, N, H] (H divisible by 4), positions int [B, T] -> rotated x, same dtype."""
  head_dim = x.shape[-1]
  if head_dim % 4:
    raise ValueError(f"RoPE needs a head dimension divisible by 4, got {head_dim}")
  rotated, passthrough = jnp.split(x, 2, axis=-1)
  quarter = head_dim // 4
  exponents = 2 * jnp.arange(quarter) / (head_dim // 2)
  inv_frequencies = 1.0 / (max_wavelength ** exponents)
  angles = positions[:, :, None, None] * inv_frequencies
  sin, cos = jnp.sin(angles).astype(x.dtype), jnp.cos(angles).astype(x.dtype)
  u, v = jnp.split(rotated, 2, axis=-1)
  return jnp.concatenate([u * cos - v * sin, v * cos + u * sin, passthrough], axis=-1)
