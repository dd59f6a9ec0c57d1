"""Causal depthwise Conv1D that never looks across a document start.

    out_t = b + Σ_{k=0..W-1} w[W-1-k] ⊙ x_{t-k}

per channel, with W = `conv_width` taps ordered oldest first (w[W-1] weighs the current
input, as in RecurrentGemma). An input x_{t-k} counts only if it belongs to the same
document as x_t, i.e. if t-k is not before the start of t's document; earlier inputs
are treated as zero.

Decoding state: the last W-1 inputs [B, W-1, C]. A call with a state sees the state as
the inputs just before its first token (and as belonging to the same document unless a
token of the call starts a new one), so prefill-then-step equals one long call. When
the state is written, inputs from before the last token's document are zeroed.
"""
from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import partitioning as P
from model.config import ModelConfig


def document_starts(segment_pos: jax.Array, index: jax.Array,
                    before: jax.Array | int) -> jax.Array:
  """Index at which each token's document starts.

  Args:
    segment_pos: int [B, T] position of each token in its document (0 starts one).
    index: int [B, T] (or [T]) running index of each token.
    before: int [B] or scalar: document start in force before the first token.

  Returns:
    int32 [B, T]: the running index of the latest document start at or before each token.
  """
  before = jnp.broadcast_to(jnp.asarray(before, jnp.int32).reshape(-1, 1),
                            (segment_pos.shape[0], 1))
  starts = jnp.where(segment_pos == 0, jnp.broadcast_to(index, segment_pos.shape), before)
  return jax.lax.cummax(starts.astype(jnp.int32), axis=1)


class Conv1D(nn.Module):
  """Depthwise causal convolution of temporal width `config.conv_width` over D_RNN channels.

  The kernel is initialised normal with variance 0.01/W (RecurrentGemma's choice: small
  taps so the block starts close to a pointwise map).
  """
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, segment_pos: jax.Array, cache: Optional[jax.Array] = None,
               return_cache: bool = False) -> tuple[jax.Array, Optional[jax.Array]]:
    """x [B, T, C], segment_pos [B, T], cache [B, W-1, C] or None -> (y [B, T, C], state)."""
    width = self.config.conv_width
    dtype: Any = self.config.dtype
    batch, length, channels = x.shape
    kernel = P.logical_param(self, "kernel", P.fan_in_normal(0.01), (width, channels),
                             (P.CONV, P.RNN)).astype(dtype)
    bias = P.logical_param(self, "bias", nn.initializers.zeros_init(), (channels,),
                           (P.RNN,)).astype(dtype)
    x = x.astype(dtype)
    history = width - 1
    if cache is None:
      state = jnp.zeros((batch, history, channels), dtype)
    else:
      state = cache.astype(dtype)
    extended = jnp.concatenate([state, x], axis=1)  # token t sits at t + history
    index = jnp.arange(length, dtype=jnp.int32)
    # Without a cache the zero state is harmless; with one it belongs to the document.
    doc_start = document_starts(segment_pos, index, -history)

    out = jnp.zeros_like(x)
    for shift in range(width):
      window = jax.lax.dynamic_slice_in_dim(extended, history - shift, length, axis=1)
      keep = (index[None, :] - shift >= doc_start)[..., None]
      out = out + jnp.where(keep, window, 0) * kernel[width - 1 - shift]
    out = out + bias
    if not return_cache:
      return out, None
    if history == 0:
      return out, jnp.zeros((batch, 0, channels), dtype)
    tail_index = jnp.arange(length - history, length, dtype=jnp.int32)
    keep = (tail_index[None, :] >= doc_start[:, -1:])[..., None]
    new_state = jnp.where(keep, extended[:, -history:], 0)
    return out, new_state

  @staticmethod
  def init_cache(config: ModelConfig, batch_size: int, dtype: Any) -> jax.Array:
    """Zero state: [B, W-1, D_RNN]."""
    return jnp.zeros((batch_size, config.conv_width - 1, config.rnn_width), dtype)
