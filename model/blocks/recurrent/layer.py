"""Griffin/Hawk recurrent temporal block.

    y-branch = GeLU(W_y x + b_y)
    x-branch = RG-LRU(Conv1D(W_x x + b_x))
    out = W_out (x-branch ⊙ y-branch) + b_out

W_x, W_y: D -> D_RNN, LeCun-normal; W_out: D_RNN -> D with variance scale 2/depth.
Decoding cache: the Conv1D's last inputs and the RG-LRU state (`RecurrentCache`).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import flax.linen as nn
import jax

from model import partitioning as P
from model.config import ModelConfig
from model.blocks.recurrent.conv1d import Conv1D
from model.blocks.recurrent.rg_lru import RGLRU


class RecurrentCache(NamedTuple):
  """Decoding state of a recurrent block."""
  conv1d: jax.Array  # [B, conv_width - 1, D_RNN], compute dtype
  rg_lru: jax.Array  # float32 [B, D_RNN] (complex64 [B, D_RNN/2] for the CG-LRU)


class RecurrentBlock(nn.Module):
  """Conv1D + RG-LRU branch gated by a GeLU branch."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, segment_pos: jax.Array,
               cache: Optional[RecurrentCache] = None, return_cache: bool = False
               ) -> tuple[jax.Array, Optional[RecurrentCache]]:
    """x [B, T, D], segment_pos [B, T] -> (y [B, T, D], updated cache or None)."""
    cfg = self.config
    rnn_activation = (P.BATCH, P.LENGTH, P.ACT_RNN)
    gate = P.Dense(cfg.rnn_width, (P.EMBED, P.RNN), dtype=cfg.dtype, name="linear_y")(x)
    gate = P.constrain(jax.nn.gelu(gate), rnn_activation)
    branch = P.Dense(cfg.rnn_width, (P.EMBED, P.RNN), dtype=cfg.dtype, name="linear_x")(x)
    branch = P.constrain(branch, rnn_activation)
    branch, conv_state = Conv1D(cfg, name="conv1d")(
        branch, segment_pos, None if cache is None else cache.conv1d, return_cache)
    branch, lru_state = RGLRU(cfg, name="rg_lru")(
        branch, segment_pos, None if cache is None else cache.rg_lru, return_cache)
    out = P.Dense(cfg.width, (P.RNN, P.EMBED), kernel_scale=2.0 / cfg.depth, dtype=cfg.dtype,
                  name="linear_out")(branch * gate)
    if not return_cache:
      return out, None
    return out, RecurrentCache(conv1d=conv_state, rg_lru=lru_state)

  @staticmethod
  def init_cache(config: ModelConfig, batch_size: int, dtype: Any) -> RecurrentCache:
    """Zero Conv1D history and zero RG-LRU state."""
    return RecurrentCache(conv1d=Conv1D.init_cache(config, batch_size, dtype),
                          rg_lru=RGLRU.init_cache(config, batch_size))
