"""Tied token embedding: tokens -> vectors on the way in, vectors -> logits on the way out.

encode(t) = E[t] (times √D if configured); decode(x) = x · Eᵀ in float32.

E is initialised normal with std 1/√D so that decode() starts with unit-variance logits
for unit-RMS inputs. The optional √D input scale (RecurrentGemma) is the bfloat16
rounding of √D, because RecurrentGemma multiplies by a bfloat16 constant even in float32
and its checkpoints were trained that way; matching it keeps imported models exact.

Under μP (`model.parametrization`) the embedding is input-like: its init std is
1/√D_base and its input scale √D_base (both constant in width), and, tied, it is also
the readout, whose logits are multiplied by 1/m.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model import parametrization
from model import partitioning as P
from model.config import ModelConfig


def embedding_scale(width: int) -> float:
  """√width rounded to bfloat16 (see the module docstring for why)."""
  return float(np.float32(math.sqrt(width)).astype(jnp.bfloat16))


class Embedder(nn.Module):
  """The tied embedding table E [vocab, width]."""
  config: ModelConfig

  def setup(self):
    self.embedding = P.logical_param(
        self, "embedding",
        nn.initializers.normal(stddev=parametrization.embedding_init_std(self.config)),
        (self.config.vocab_size, self.config.width), (P.VOCAB, P.EMBED))

  def encode(self, tokens: jax.Array) -> jax.Array:
    """int32 [B, T] -> [B, T, D] in the compute dtype."""
    x = jnp.take(self.embedding, tokens, axis=0).astype(self.config.dtype)
    if self.config.embeddings_scale_by_sqrt_dim:
      scale = embedding_scale(parametrization.input_scale_width(self.config))
      x = x * jnp.asarray(scale, x.dtype)
    return x

  def decode(self, x: jax.Array) -> jax.Array:
    """[B, T, D] -> float32 logits [B, T, V]."""
    return readout(self.config, x, self.embedding)


def readout(config: ModelConfig, x: jax.Array, embedding: jax.Array) -> jax.Array:
  """`tied_logits` times μP's output multiplier 1/m (not multiplied at all under the
  standard parametrisation)."""
  logits = tied_logits(x, embedding)
  multiplier = parametrization.logit_multiplier(config)
  return logits if multiplier is None else logits * multiplier


def tied_logits(x: jax.Array, embedding: jax.Array) -> jax.Array:
  """[B, T, D] states times the [V, D] table in x's dtype -> float32 logits [B, T, V]."""
  return jnp.einsum("btd,vd->btv", x, embedding.astype(x.dtype),
                    preferred_element_type=jnp.float32)
