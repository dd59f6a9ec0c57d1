"""Multi-query attention (MQA), local (sliding window) or global, document-aware.

    q = x W_q  (H heads of size d = D/H),  k = x W_k,  v = x W_v  (one shared head),
    q, k <- RoPE(q, k) on the first half of each head, positions restarting per document,
    s_{t,u} = q_t · k_u / √d   if  u ≤ t,  u ≥ start of t's document,  and t - u ≤ window,
                               (√d_base / d in place of 1/√d under μP: q is scaled by 1/√m)
    y_t = W_out Σ_u softmax_u(s_{t,u}) v_u + b_out.

With `attention_window = w`, a query sees the keys t-w … t (w+1 of them), as in
RecurrentGemma. Scores, masking and softmax are float32 whatever the compute dtype.

Training calls (no cache) of local attention longer than the window are computed in
blocks of w queries, each attending to its own and the previous block's keys
(`_blocked_local_attention`): 2·w·T scores instead of T² (less work from T = 4w on).
When the mesh splits time into shards of whole blocks, the previous block is a one-block
halo sent to the right neighbour with a ppermute (`model.time_shift.delayed`). Global
attention (and any call of at most w tokens, or with a cache) uses the full masked score
matrix; under a sequence-split mesh the partitioner then gathers the keys and values over
the time shards, which is affordable because the single K/V head is 1/N of the query
width.

Training calls may instead run a fused kernel that never materialises the scores
(`model.blocks.attention.fused`, chosen by `ModelConfig.attention`; splash attention on
TPU). This module's masked softmax stays the reference they are tested against, the CPU
path, and the path of every call with a cache.

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

from model import parametrization
from model import partitioning as P
from model.blocks.attention import fused
from model.config import ModelConfig
from model.rope import apply_rope
from model.time_shift import delayed
from model.time_shift import document_starts

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


def _attend(queries: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array,
            dtype: Any) -> jax.Array:
  """Masked softmax attention of [..., T, N, d] queries over [..., S, d] shared keys/values.

  mask [..., T, S] (True = may attend); scores and softmax in float32. Returns
  [..., T, N, d] in `dtype`.
  """
  logits = jnp.einsum("...tnh,...sh->...nts", queries, keys,
                      preferred_element_type=jnp.float32)
  logits = logits * queries.shape[-1] ** -0.5
  logits = jnp.where(jnp.expand_dims(mask, -3), logits, MASKED_LOGIT)
  probs = jax.nn.softmax(logits, axis=-1).astype(dtype)
  return jnp.einsum("...nts,...sh->...tnh", probs, values.astype(dtype))


def _causal_mask(query_index: jax.Array, key_index: jax.Array, doc_start: jax.Array,
                 window: Optional[int]) -> jax.Array:
  """[B, T, S]: key at or before the query, in its document, within the window."""
  query_index, key_index = query_index[:, :, None], key_index[:, None, :]
  mask = (key_index <= query_index) & (key_index >= doc_start[:, :, None])
  if window is not None:
    mask &= query_index - key_index <= window
  return mask


def xla_attention(queries: jax.Array, keys: jax.Array, values: jax.Array,
                  segment_pos: jax.Array, window: Optional[int], dtype: Any) -> jax.Array:
  """Masked MQA of a cache-less call in XLA: the reference of the fused kernels.

  Local attention longer than the window takes the blocked path; global attention and
  calls no longer than the window (where the full matrix is the same work) take the
  full masked score matrix.

  Args:
    queries: [B, T, N, d] (RoPE applied); keys, values: [B, T, d].
    segment_pos: int [B, T]; 0 starts a document.
    window: keys t-window … t are seen (None = global).
    dtype: compute dtype of the probabilities and output.

  Returns:
    [B, T, N, d].
  """
  batch, length = segment_pos.shape
  if window is not None and length > window:
    return _blocked_local_attention(queries, keys, values, segment_pos, window, dtype)
  index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  mask = _causal_mask(index, index, document_starts(segment_pos, index, 0), window)
  return _attend(queries, keys, values, mask, dtype)


def training_choice(config: ModelConfig, length: int) -> fused.Choice:
  """The implementation of a cache-less call of `length` tokens on the mesh in scope."""
  layout = P.sequence_sharding(length, (P.BATCH, P.LENGTH))
  return fused.choose(config.attention, config.scan, config.attention_window, length,
                      None if layout is None else layout.axis)


def _blocked_local_attention(queries: jax.Array, keys: jax.Array, values: jax.Array,
                             segment_pos: jax.Array, window: int, dtype: Any) -> jax.Array:
  """Sliding-window attention computed block by block.

  Queries are cut into blocks of C = window tokens; block b attends to the keys of blocks
  b-1 and b (2C keys), which hold every key its queries may see (t-C .. t). The masks are
  those of the full-matrix path restricted to that window, so the result is the same,
  while the work is 2·C·T scores instead of T² (the same at T = 2C, half at 4C, a quarter
  at 8C). Everything is local to a block except the
  previous block's keys, values and reset flags, so with the time axis split over whole
  blocks per shard, the only communication is that one-block halo. A length that is not a
  multiple of C is padded at the end (causality keeps the padding out of real tokens'
  results); under a sequence mesh, choose T/shards a multiple of C to avoid that reshard.

  Args:
    queries: [B, T, N, d] (RoPE applied); keys, values: [B, T, d].
    segment_pos: int [B, T]; 0 starts a document.
    window: the attention window C.
    dtype: compute dtype of the probabilities and output.

  Returns:
    [B, T, N, d].
  """
  batch, length, heads, head_dim = queries.shape
  blocks = -(-length // window)
  padding = blocks * window - length
  if padding:
    pad_time = lambda x: jnp.pad(x, [(0, 0), (0, padding)] + [(0, 0)] * (x.ndim - 2))
    queries, keys, values, segment_pos = map(pad_time,
                                             (queries, keys, values, segment_pos))

  def by_block(x):  # [B, T, ...] -> [B, T/C, C, ...]
    return x.reshape(batch, blocks, window, *x.shape[2:])

  def with_previous(x, axes):  # [B, T, ...] -> [B, T/C, 2C, ...]: block b-1, block b
    return jnp.concatenate([by_block(delayed(x, window, axes)), by_block(x)], axis=2)

  block_queries = P.constrain(by_block(queries),
                              (P.BATCH, P.LENGTH, None, P.ACT_HEADS, None))
  kv_axes, block_kv_axes = (P.BATCH, P.LENGTH, None), (P.BATCH, P.LENGTH, None, None)
  block_keys = P.constrain(with_previous(keys, kv_axes), block_kv_axes)
  block_values = P.constrain(with_previous(values, kv_axes), block_kv_axes)
  # Key j of block b's window is token (b-1)C + j; query i is token bC + i.
  starts = with_previous(segment_pos == 0, (P.BATCH, P.LENGTH))  # [B, T/C, 2C]
  key_slot = jnp.arange(2 * window, dtype=jnp.int32)
  # The latest document start in the window at or before each key slot (0 if none: the
  # document began before the window, so every key in it up to the query counts).
  doc_start = jax.lax.cummax(jnp.where(starts, key_slot, 0), axis=2)
  query_slot = key_slot[window:]
  mask = ((key_slot[None, :] <= query_slot[:, None])
          & (query_slot[:, None] - key_slot[None, :] <= window))
  mask = mask & (key_slot[None, :] >= doc_start[:, :, window:, None])
  first_block = jnp.arange(blocks) == 0  # its previous block lies before the sequence
  mask = mask & ~(first_block[:, None, None] & (key_slot < window))[None]
  encoded = _attend(block_queries, block_keys, block_values, mask, dtype)
  return encoded.reshape(batch, blocks * window, heads, head_dim)[:, :length]


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
    queries = apply_rope(queries, segment_pos)
    query_multiplier = parametrization.query_multiplier(cfg)
    if query_multiplier is not None:   # μP: scores q·k·√d_base/d, not q·k/√d
      queries = queries * jnp.asarray(query_multiplier, queries.dtype)
    queries = P.constrain(queries, (P.BATCH, P.LENGTH, P.ACT_HEADS, None))
    keys = apply_rope(keys[:, :, None], segment_pos)[:, :, 0]

    if cache is None:
      choice = training_choice(cfg, length)
      if choice.impl == "xla":
        encoded = xla_attention(queries, keys, values, segment_pos, cfg.attention_window,
                                cfg.dtype)
      else:
        encoded = fused.fused_attention(
            choice.impl, queries, keys, values, segment_pos, cfg.attention_window,
            cfg.attention, fused.interpret_mode(cfg.attention, cfg.scan), cfg.dtype)
    else:
      index = cache.next_index[:, None] + jnp.arange(length, dtype=jnp.int32)
      doc_start = document_starts(segment_pos, index, cache.doc_start)
      all_keys = jnp.concatenate([cache.keys.astype(keys.dtype), keys], axis=1)
      all_values = jnp.concatenate([cache.values.astype(values.dtype), values], axis=1)
      key_index = jnp.concatenate([cache.key_index, index], axis=1)
      mask = _causal_mask(index, key_index, doc_start, cfg.attention_window)
      encoded = _attend(queries, all_keys, all_values, mask, cfg.dtype)
    encoded = encoded.reshape(batch, length, cfg.width)
    out = P.Dense(cfg.width, (P.Q_HEADS, P.EMBED), kernel_scale=2.0 / cfg.depth,
                  dtype=cfg.dtype, name="out")(encoded)

    if not return_cache:
      return out, None
    if cache is None:  # a prompt's call: the cache starts at running index 0
      cache = _empty_cache(cfg, batch, keys.dtype, cache_size(cfg, None))
      index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
      doc_start = document_starts(segment_pos, index, 0)
    return out, _write(cache, keys, values, index, doc_start)

  @staticmethod
  def init_cache(config: ModelConfig, batch_size: int, dtype: Any,
                 max_length: Optional[int] = None) -> AttentionCache:
    """An empty ring buffer (see `cache_size` for its length)."""
    return _empty_cache(config, batch_size, dtype, cache_size(config, max_length))
