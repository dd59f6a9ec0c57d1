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

Sequence parallelism: every term is a delayed copy of the input (and of the reset flags)
by at most W-1 steps, so when the mesh splits time each shard needs only the last W-1
inputs of its left neighbour, which `model.time_shift.delayed` exchanges with a collective-permute
(tests/test_sequence_parallel_model.py checks the compiled program).
"""
from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import partitioning as P
from model.config import ModelConfig
from model.time_shift import delayed


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
    kernel_init = nn.initializers.variance_scaling(0.01, "fan_in", "normal", in_axis=0,
                                                   out_axis=1)
    kernel = P.logical_param(self, "kernel", kernel_init, (width, channels),
                             (P.CONV, P.RNN)).astype(dtype)
    bias = P.logical_param(self, "bias", nn.initializers.zeros_init(), (channels,),
                           (P.RNN,)).astype(dtype)
    x = x.astype(dtype)
    history = width - 1
    state = None if cache is None else cache.astype(dtype)
    # keep[s][b, t]: input x_{t-s} belongs to t's document, i.e. no document starts in
    # (t-s, t]. Built from shifted reset flags rather than a cumulative max over time, so
    # every step is local to a window of W tokens (see `delayed`).
    activation = (P.BATCH, P.LENGTH, P.ACT_RNN)
    continues = segment_pos != 0
    keep = [jnp.ones_like(continues)]
    for shift in range(1, width):
      keep.append(keep[-1] & delayed(continues, shift - 1, activation[:2], fill=True))
    # Inputs x_{t-s} that count for token t, for s = 0 .. W-1.
    taps = [jnp.where(keep[shift][..., None],
                      delayed(x, shift, activation, history=state), 0)
            for shift in range(width)]
    out = jnp.zeros_like(x)
    for shift in range(width):
      out = out + taps[shift] * kernel[width - 1 - shift]
    out = out + bias
    if not return_cache:
      return out, None
    # The new state is x_{T-1-s} for s = W-2 .. 0 as the last token sees them (zero before
    # its document).
    new_state = [taps[shift][:, -1:] for shift in reversed(range(history))]
    if not new_state:
      return out, jnp.zeros((batch, 0, channels), dtype)
    return out, jnp.concatenate(new_state, axis=1)

  @staticmethod
  def init_cache(config: ModelConfig, batch_size: int, dtype: Any) -> jax.Array:
    """Zero state: [B, W-1, D_RNN]."""
    return jnp.zeros((batch_size, config.conv_width - 1, config.rnn_width), dtype)
