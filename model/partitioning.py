"""Logical axis names for parameters and activations, and a dense layer that carries them.

Every parameter is declared with logical axis names (docs/INTERNALS.md) so the sharding
rules in `sharding/` can map them to mesh axes; every key activation is constrained with
logical names, which is a no-op until a mesh and rules are in scope.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

# Parameter axes.
VOCAB = "vocab"
EMBED = "embed"
MLP = "mlp"
RNN = "rnn"
RNN_HEADS = "rnn_heads"
RNN_HEAD_DIM = "rnn_head_dim"
Q_HEADS = "q_heads"
KV = "kv"
CONV = "conv"
LAYERS = "layers"
NORM = "norm"

# Activation axes.
BATCH = "batch"
LENGTH = "length"
ACT_EMBED = "act_embed"
ACT_MLP = "act_mlp"
ACT_RNN = "act_rnn"
ACT_HEADS = "act_heads"
ACT_VOCAB = "act_vocab"

Initializer = Callable[..., jax.Array]
Axes = Sequence[Optional[str]]


def logical_param(module: nn.Module, name: str, init: Initializer, shape: Sequence[int],
                  axes: Axes) -> jax.Array:
  """Declares a float32 parameter whose dimensions carry the logical names `axes`."""
  if len(axes) != len(shape):
    raise ValueError(f"parameter {name!r}: {len(axes)} axis names for shape {tuple(shape)}")
  return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape),
                      jnp.float32)


def constrain(x: jax.Array, axes: Axes) -> jax.Array:
  """Constrains an activation's sharding by logical names (no-op without a mesh)."""
  return nn.with_logical_constraint(x, tuple(axes))


def fan_in_normal(scale: float = 1.0, fan_in_axes: Sequence[int] = (0,)) -> Initializer:
  """Normal init with variance scale / fan_in, fan_in the product of `fan_in_axes`."""
  def init(key, shape, dtype=jnp.float32):
    fan_in = 1
    for axis in fan_in_axes:
      fan_in *= shape[axis]
    return (jax.random.normal(key, shape, jnp.float32) * (scale / fan_in) ** 0.5).astype(dtype)
  return init


class Dense(nn.Module):
  """y = x · W (+ b) over the last axis of x, computed in `dtype`.

  Attributes:
    features: output width.
    kernel_axes: logical names of the [in, out] kernel; the bias takes the second.
    kernel_scale: variance scale of the fan-in normal init (1 = LeCun normal).
    use_bias: add a zero-initialised bias.
    dtype: compute dtype (parameters stay float32).
  """
  features: int
  kernel_axes: tuple[Optional[str], Optional[str]]
  kernel_scale: float = 1.0
  use_bias: bool = True
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = logical_param(self, "kernel", fan_in_normal(self.kernel_scale),
                           (x.shape[-1], self.features), self.kernel_axes)
    y = jnp.einsum("...i,io->...o", x.astype(self.dtype), kernel.astype(self.dtype))
    if self.use_bias:
      bias = logical_param(self, "bias", nn.initializers.zeros_init(), (self.features,),
                           self.kernel_axes[1:])
      y = y + bias.astype(self.dtype)
    return y
