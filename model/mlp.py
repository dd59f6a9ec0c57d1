"""Gated MLP: MLP(x) = W_down( GeLU(W_gate x + b_gate) ⊙ (W_up x + b_up) ) + b_down.

GeLU is the tanh approximation. The inner width is `mlp_expansion · D`. The gate and up
kernels are initialised normal with variance 1/(2D): RecurrentGemma stores them as one
[2, D, M] tensor whose fan-in counts both halves, and we keep its initial statistics.
W_down (the block's last projection) gets variance (2/depth)/M so the residual stream's
variance stays O(1) at any depth.
"""
from __future__ import annotations

import flax.linen as nn
import jax

from model import partitioning as P
from model.config import ModelConfig


class GatedMLP(nn.Module):
  """The channel-mixing half of a residual block."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    up_axes = (P.EMBED, P.MLP)
    gate = P.Dense(cfg.mlp_width, up_axes, kernel_scale=0.5, dtype=cfg.dtype, name="gate")(x)
    up = P.Dense(cfg.mlp_width, up_axes, kernel_scale=0.5, dtype=cfg.dtype, name="up")(x)
    hidden = P.constrain(jax.nn.gelu(gate) * up, (P.BATCH, P.LENGTH, P.ACT_MLP))
    return P.Dense(cfg.width, (P.MLP, P.EMBED), kernel_scale=2.0 / cfg.depth,
                   dtype=cfg.dtype, name="down")(hidden)
