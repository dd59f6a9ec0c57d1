"""Decoding caches and the prefill / step calls that use them.

A cache holds, per layer, what the next token needs from the past: the RG-LRU state and
the Conv1D's last inputs for recurrent blocks (constant size), a ring buffer of the local
window's keys and values for local attention (constant size), or of `max_length` tokens
for global attention. Its structure mirrors the parameters:

    {"blocks": tuple over the block pattern of caches stacked on [num_scanned_units],
     "remainder": tuple of the trailing partial unit's caches}

Usage: `prefill` runs the prompt (any length, longer than the window included) and
returns the logits and the filled cache; `decode_step` then feeds one token at a time.
Both are the model's own call with `return_cache=True`, so there is one code path for
training and decoding.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.lm import LanguageModel
from model.residual_block import init_block_cache


def _stack(trees: list[Any]) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def init_cache(config: ModelConfig, batch_size: int, dtype: Any = jnp.float32,
               max_length: Optional[int] = None) -> dict:
  """An empty cache for `batch_size` sequences.

  Args:
    config: the model.
    batch_size: number of sequences decoded together.
    dtype: dtype of stored activations (Conv1D inputs, keys, values); recurrent states
      are always float32 (complex64 for the CG-LRU).
    max_length: longest sequence (prompt + generated) to decode. Required with global
      attention (its cache holds every token); caps the local-attention buffer otherwise.
  """
  def block(block_type):
    return init_block_cache(config, block_type, batch_size, dtype, max_length)

  blocks = ()
  if config.num_scanned_units:
    blocks = tuple(_stack([block(b)] * config.num_scanned_units)
                   for b in config.block_pattern)
  return {"blocks": blocks,
          "remainder": tuple(block(b) for b in config.remainder_block_types)}


def prefill(config: ModelConfig, params: Any, tokens: jax.Array, positions: jax.Array,
            cache: Optional[dict] = None) -> tuple[jax.Array, dict]:
  """Runs a prompt; returns (float32 logits [B, T, V], cache ready for `decode_step`).

  `cache=None` builds the cache from the prompt alone (enough for recurrent and local
  attention blocks); global attention needs `cache=init_cache(..., max_length=...)`.
  """
  return LanguageModel(config).apply({"params": params}, tokens, positions, cache=cache,
                                     return_cache=True)


def decode_step(config: ModelConfig, params: Any, tokens: jax.Array, positions: jax.Array,
                cache: dict) -> tuple[jax.Array, dict]:
  """Feeds tokens [B, 1] at `positions` [B, 1]; returns (logits [B, 1, V], new cache)."""
  return LanguageModel(config).apply({"params": params}, tokens, positions, cache=cache,
                                     return_cache=True)
