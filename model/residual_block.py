"""Pre-norm residual block: a temporal-mixing block then a gated MLP.

    r = x + Temporal(RMSNorm(x)),   out = r + MLP(RMSNorm(r)).

The temporal block is whatever `ModelConfig.block_pattern` names, looked up in
`model.block_registry` ("recurrent": Conv1D + RG-LRU, "attention": local or global MQA,
"gateloop", or a registered block of one's own). All share one interface, so caches and
depth scanning treat them alike:

    block = spec.layer(config)
    y, cache = block(x [B, T, D], segment_pos [B, T], cache=None, return_cache=False)
    spec.init_cache(config, batch_size, dtype, max_length)

A block that declares no `init_cache` starts decoding from zeros shaped like the cache
its layer returns for one token: the empty state of a recurrence whose state starts at
zero. A cache that grows with `max_length`, or whose empty state is not zero (the
attention ring buffer's -1 slots), is declared by its block.
"""
from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import block_registry
from model import partitioning as P
from model.config import ModelConfig
from model.mlp import GatedMLP
from model.norms import RMSNorm


def init_block_cache(config: ModelConfig, block_type: str, batch_size: int, dtype: Any,
                     max_length: Optional[int] = None) -> Any:
  """Empty decoding cache of one residual block (its block's, or zeros: module docstring).

  Raises:
    ValueError: the block declares no cache and its layer returns none.
  """
  block = block_registry.get(block_type)
  if block.init_cache is not None:
    return block.init_cache(config, batch_size, dtype, max_length)
  layer = block.layer(config)

  def one_token_cache(x, segment_pos):
    (_, cache), _ = layer.init_with_output(jax.random.key(0), x, segment_pos, None, True)
    return cache

  shapes = jax.eval_shape(one_token_cache,
                          jax.ShapeDtypeStruct((batch_size, 1, config.width), dtype),
                          jax.ShapeDtypeStruct((batch_size, 1), jnp.int32))
  if not jax.tree_util.tree_leaves(shapes):
    raise ValueError(f"{block.title} blocks return no decoding cache and declare no "
                     "init_cache; decoding needs one")
  return jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), shapes)


class ResidualBlock(nn.Module):
  """One layer of the network.

  Attributes:
    config: the model.
    block_type: temporal block type; its module is named after it ("recurrent", ...).
  """
  config: ModelConfig
  block_type: str

  @nn.compact
  def __call__(self, x: jax.Array, segment_pos: jax.Array, cache: Any = None,
               return_cache: bool = False) -> tuple[jax.Array, Any]:
    cfg = self.config
    temporal = block_registry.get(self.block_type).layer(cfg, name=self.block_type)
    mixed, cache = temporal(RMSNorm(cfg.dtype, name="temporal_norm")(x), segment_pos,
                            cache, return_cache)
    residual = mixed + x
    out = GatedMLP(cfg, name="mlp")(RMSNorm(cfg.dtype, name="mlp_norm")(residual)) + residual
    return P.constrain(out, (P.BATCH, P.LENGTH, P.ACT_EMBED)), cache
