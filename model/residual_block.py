"""Pre-norm residual block: a temporal-mixing block then a gated MLP.

    r = x + Temporal(RMSNorm(x)),   out = r + MLP(RMSNorm(r)).

The temporal block is chosen by type: "recurrent" (Conv1D + RG-LRU), "attention" (local or
global MQA) or "gateloop" (imported lazily from `model.gateloop`). All three share one
interface, so caches and depth scanning treat them alike:

    block = Cls(config)
    y, cache = block(x [B, T, D], segment_pos [B, T], cache=None, return_cache=False)
    Cls.init_cache(config, batch_size, dtype)      # attention also takes max_length
"""
from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax

from model import partitioning as P
from model.attention import AttentionBlock
from model.config import BlockType, ModelConfig
from model.mlp import GatedMLP
from model.norms import RMSNorm
from model.recurrent_block import RecurrentBlock
from model.gateloop import GateLoopBlock


def temporal_block_class(block_type: str) -> type[nn.Module]:
  """The module class implementing a block type of `ModelConfig.block_pattern`."""
  if block_type == BlockType.RECURRENT.value:
    return RecurrentBlock
  if block_type == BlockType.ATTENTION.value:
    return AttentionBlock
  if block_type == BlockType.GATELOOP.value:
    return GateLoopBlock
  raise ValueError(f"unknown block type {block_type!r}; expected one of "
                   f"{sorted(b.value for b in BlockType)}")


def init_block_cache(config: ModelConfig, block_type: str, batch_size: int, dtype: Any,
                     max_length: Optional[int] = None) -> Any:
  """Empty decoding cache of one residual block."""
  if block_type == BlockType.ATTENTION.value:
    return AttentionBlock.init_cache(config, batch_size, dtype, max_length)
  return temporal_block_class(block_type).init_cache(config, batch_size, dtype)


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
    temporal = temporal_block_class(self.block_type)(cfg, name=self.block_type)
    mixed, cache = temporal(RMSNorm(cfg.dtype, name="temporal_norm")(x), segment_pos,
                            cache, return_cache)
    residual = mixed + x
    out = GatedMLP(cfg, name="mlp")(RMSNorm(cfg.dtype, name="mlp_norm")(residual)) + residual
    return P.constrain(out, (P.BATCH, P.LENGTH, P.ACT_EMBED)), cache
