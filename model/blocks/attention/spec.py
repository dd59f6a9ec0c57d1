"""The MQA attention block's registry entry, local (sliding window) or global.

`ModelConfig.attention_window` picks local attention (keys t-w..t) or, when None,
global attention, whose decoding cache needs a `max_length`. The layer is
`model.blocks.attention.layer.AttentionBlock`. It declares every capability of
`model.block_registry`: counting (the score FLOPs grow with the window, which no
default could guess), memory terms (the float32 scores on XLA's path, one log-sum-exp
per query head where a fused kernel runs) and the transformers mapping.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import numpy as np

from model import partitioning as P
from model.block_registry import HFLeaf, ParamRole
from model.blocks.attention import fused
from model.blocks.attention.layer import AttentionBlock, AttentionCache
from model.config import BlockType, ModelConfig

# Float32 buffers per score kept for the backward pass: masked scores and probabilities
# (calibration: `model.memory`).
KEEP_SCORES = 2


def mean_attended_keys(window: Optional[int], seq_len: int) -> float:
  """Mean keys per query under the causal (and local-window) mask, T tokens per row:
  S̄(T) of docs/model.md#training-flops (`model.counting`)."""
  t = np.arange(seq_len, dtype=np.float64)
  keys = t + 1 if window is None else np.minimum(t + 1, window + 1)
  return float(keys.mean())


def score_columns(config: ModelConfig, seq: int) -> int:
  """Key columns of the float32 score matrix one query materialises: 2·window on the
  blocked local path (T > window), else T (global, or a call within the window)."""
  window = config.attention_window
  return 2 * window if window is not None and seq > window else seq


def runs_fused(config: ModelConfig, seq: int) -> bool:
  """Whether training calls of `seq` tokens run a fused kernel on the config's target
  (`model.blocks.attention.fused.choose`; a mesh that splits time is not seen here)."""
  return fused.choose(config.attention, config.scan, config.attention_window, seq,
                      None).impl != "xla"


def kept_scores(config: ModelConfig, seq: int, tensor: int) -> float:
  """Float32 elements per token that attention keeps for its backward pass beyond its
  inputs and output: the masked scores and probabilities on XLA's path, the one
  log-sum-exp per query head a fused kernel saves."""
  heads = config.num_heads / tensor
  if runs_fused(config, seq):
    return heads
  return KEEP_SCORES * heads * score_columns(config, seq)


class _AttentionCounting:
  """The 6N weights and the attention scores' work."""

  def matmul_params(self, config: ModelConfig) -> int:
    d = config.width
    return 2 * d * d + 2 * d * config.head_dim             # W_q, W_out; one K/V head

  def mixing_flops(self, config: ModelConfig, seq_len: int) -> dict[str, float]:
    # q·k and the weighted sum of values: 4·D FLOPs per attended key forward.
    keys = mean_attended_keys(config.attention_window, seq_len)
    return {"attention": 12.0 * config.width * keys}


class _AttentionMemory:
  """Per-token terms of the analytic planner."""

  def kept_activations(self, config: ModelConfig, seq: int, tensor: int
                       ) -> tuple[float, float, float]:
    scores = kept_scores(config, seq, tensor)
    return 2 * config.width / tensor + 2 * config.head_dim, scores, scores

  def saved_matmul_outputs(self, config: ModelConfig, seq: int, tensor: int
                           ) -> tuple[float, float]:
    d = config.width
    return d / tensor + 2 * config.head_dim + d, kept_scores(config, seq, tensor)


class _AttentionHFExport:
  """transformers' `temporal_block` of an attention RecurrentGemma layer."""

  def check(self, config: ModelConfig) -> None:
    del config  # local and global windows both map (hf_params.hf_config)

  def leaves(self) -> list[HFLeaf]:
    leaves = [(("attention_block", ours, "kernel"), f"temporal_block.{theirs}.weight", True)
              for ours, theirs in (("proj_q", "q_proj"), ("proj_k", "k_proj"),
                                   ("proj_v", "v_proj"), ("proj_final", "o_proj"))]
    leaves.append((("attention_block", "proj_final", "bias"), "temporal_block.o_proj.bias",
                   False))
    return leaves

  def to_hf(self, layer: Mapping[str, Any]) -> dict[str, np.ndarray]:
    del layer
    return {}

  def from_hf(self, take: Callable[[str], np.ndarray]) -> dict[tuple[str, ...], np.ndarray]:
    del take
    return {}


class AttentionSpec:
  """Registry entry of "attention" (docs/model.md: local and global MQA)."""
  name = BlockType.ATTENTION.value
  title = "MQA attention"
  layer = AttentionBlock
  family = "mqa"
  logical_axes = (P.EMBED, P.Q_HEADS, P.KV, P.BATCH, P.LENGTH, P.ACT_HEADS)
  counting = _AttentionCounting()
  memory = _AttentionMemory()
  hf_export = _AttentionHFExport()
  # μP (docs/model.md): the projections are hidden; the scores' 1/d is the layer's
  # (`model.parametrization.query_multiplier`).
  param_roles = {"q/kernel": ParamRole.HIDDEN, "k/kernel": ParamRole.HIDDEN,
                 "v/kernel": ParamRole.HIDDEN, "out/kernel": ParamRole.HIDDEN,
                 "out/bias": ParamRole.VECTOR}

  def validate(self, config: ModelConfig) -> None:
    if config.head_dim % 4:
      raise ValueError(
          f"ModelConfig: head dimension width/num_heads = {config.head_dim} must be "
          "divisible by 4: rotary embeddings rotate pairs of channels in the first half "
          "of each head")

  def init_cache(self, config: ModelConfig, batch_size: int, dtype: Any,
                 max_length: Optional[int]) -> AttentionCache:
    return AttentionBlock.init_cache(config, batch_size, dtype, max_length)

  def param_count(self, config: ModelConfig) -> int:
    return self.counting.matmul_params(config) + config.width   # + the output bias
