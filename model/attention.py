"""Multi-query attention (MQA), local (sliding window) or global, document-aware.

    q = x W_q  (H heads of size d = D/H),  k = x W_k,  v = x W_v  (one shared head),
    q, k <- RoPE(q, k) on the first half of each head, positions restarting per document,
    s_{t,u} = q_t · k_u / √d   if  u ≤ t,  u ≥ start of t's document,  and t - u ≤ window,
    y_t = W_out Σ_u softmax_u(s_{t,u}) v_u + b_out.

With `attention_window = w`, a query sees the keys t-w … t (w+1 of them), as in
RecurrentGemma. Scores, masking and softmax are float32 whatever the compute dtype.

Decoding cache (`AttentionCache`): a ring buffer of S slots holding RoPE'd keys and values;
slot `i % S` holds the token with running index i. S = window for local attention (the
current token is attended from the call's own keys, so S previous keys suffice), and a
given `max_length` for global attention (a global cache that overflows degrades to a
sliding window of `max_length`). `key_index` records the running index of each slot (-1 =
empty), `next_index` the running index of the next token and `doc_start` the running index
at which the current document started, so masking in decode uses the same three rules as
in training.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import partitioning as P
from model.config import ModelConfig
from model.conv1d import document_starts
from model.rope import apply_rope

MASKED_LOGIT = -2.3819763e38


class AttentionCache(NamedTuple):
  """Ring-buffer KV cache of one attention block (see the module docstring)."""
  keys: jax.Array        # [B, S, d] compute dtype
  values: jax.Array      # [B, S, d] compute dtype
  key_index: jax.Array   # int32 [B, S], running index of each slot, -1 = empty
  next_index: jax.Array  # int32 [B]
  doc_start: jax.Array   # int32 [B]


def cache_size(config: ModelConfig, max_length: Optional[int]) -> int:
  """Slots of the ring buffer: the window for local attention, else `max_length`."""
  if config.attention_window is None:
    if max_length is None:
      raise ValueError(
          "global attention (ModelConfig.attention_window=None) needs a KV-cache of a known "
          "length: pass max_length to model.decoding.init_cache and call the model with "
          "cache=init_cache(...) for the prompt instead of cache=None")
    return max_length
  if max_length is None:
    return config.attention_window
  return min(config.attention_window, max_length)


def _empty_cache(config: ModelConfig, batch_size: int, dtype: Any, size: int) -> AttentionCache:
  shape = (batch_size, size, config.head_dim)
  return AttentionCache(
      keys=jnp.zeros(shape, dtype), values=jnp.zeros(shape, dtype),
      key_index=jnp.full((batch_size, size), -1, jnp.int32),
      next_index=jnp.zeros((batch_size,), jnp.int32),
      doc_start=jnp.zeros((batch_size,), jnp.int32))


def _write(cache: AttentionCache, keys: jax.Array, values: jax.Array, index: jax.Array,
           doc_start: jax.Array) -> AttentionCache:
  """Stores the last min(T, S) of the call's keys/values at slots index % S."""
  size = cache.keys.shape[1]
  n = min(keys.shape[1], size)
  index = index[:, -n:]
  rows = jnp.arange(keys.shape[0])[:, None]
  slots = index % size
  return AttentionCache(
      keys=cache.keys.at[rows, slots].set(keys[:, -n:].astype(cache.keys.dtype)),
      values=cache.values.at[rows, slots].set(values[:, -n:].astype(cache.values.dtype)),
      key_index=cache.key_index.at[rows, slots].set(index),
      next_index=index[:, -1] + 1,
      doc_start=doc_start[:, -1])


class AttentionBlock(nn.Module):
  """Local or global MQA temporal block; q/k/v LeCun-normal, W_out variance 2/depth."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, segment_pos: jax.Array,
               cache: Optional[AttentionCache] = None, return_cache: bool = False
               ) -> tuple[jax.Array, Optional[AttentionCache]]:
    """x [B, T, D], segment_pos [B, T] -> (y [B, T, D], updated cache or None)."""
    cfg = self.config
    batch, length, _ = x.shape
    heads, head_dim = cfg.num_heads, cfg.head_dim
    queries = P.Dense(cfg.width, (P.EMBED, P.Q_HEADS), use_bias=False, dtype=cfg.dtype,
                      name="q")(x).reshape(batch, length, heads, head_dim)
    keys = P.Dense(head_dim, (P.EMBED, P.KV), use_bias=False, dtype=cfg.dtype, name="k")(x)
    values = P.Dense(head_dim, (P.EMBED, P.KV), use_bias=False, dtype=cfg.dtype, name="v")(x)
    queries = P.constrain(apply_rope(queries, segment_pos),
                          (P.BATCH, P.LENGTH, P.ACT_HEADS, None))
    keys = apply_rope(keys[:, :, None], segment_pos)[:, :, 0]

    if cache is None:
      index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
      doc_start = document_starts(segment_pos, index, 0)
      all_keys, all_values, key_index = keys, values, index
    else:
      index = cache.next_index[:, None] + jnp.arange(length, dtype=jnp.int32)
      doc_start = document_starts(segment_pos, index, cache.doc_start)
      all_keys = jnp.concatenate([cache.keys.astype(keys.dtype), keys], axis=1)
      all_values = jnp.concatenate([cache.values.astype(values.dtype), values], axis=1)
      key_index = jnp.concatenate([cache.key_index, index], axis=1)

    query_index, key_index = index[:, :, None], key_index[:, None, :]
    mask = (key_index <= query_index) & (key_index >= doc_start[:, :, None])
    if cfg.attention_window is not None:
      mask &= query_index - key_index <= cfg.attention_window

    logits = jnp.einsum("btnh,bsh->bnts", queries, all_keys,
                        preferred_element_type=jnp.float32)
    logits = logits * head_dim ** -0.5
    logits = jnp.where(mask[:, None], logits, MASKED_LOGIT)
    probs = jax.nn.softmax(logits, axis=-1).astype(cfg.dtype)
    encoded = jnp.einsum("bnts,bsh->btnh", probs, all_values.astype(cfg.dtype))
    encoded = encoded.reshape(batch, length, cfg.width)
    out = P.Dense(cfg.width, (P.Q_HEADS, P.EMBED), kernel_scale=2.0 / cfg.depth,
                  dtype=cfg.dtype, name="out")(encoded)

    if not return_cache:
      return out, None
    if cache is None:
      cache = _empty_cache(cfg, batch, keys.dtype, cache_size(cfg, None))
    return out, _write(cache, keys, values, index, doc_start)

  @staticmethod
  def init_cache(config: ModelConfig, batch_size: int, dtype: Any,
                 max_length: Optional[int] = None) -> AttentionCache:
    """An empty ring buffer (see `cache_size` for its length)."""
    return _empty_cache(config, batch_size, dtype, cache_size(config, max_length))
