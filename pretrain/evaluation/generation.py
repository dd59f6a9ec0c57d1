"""Sampling from a model: one prefill of the prompt, then cached decode steps.

The prompt runs once (prefill), filling the decoding caches: RG-LRU states, Conv1D
tails and local-attention ring buffers (constant size per token for Griffin and Hawk).
Then each new token is one cached decode step; the prefix is never re-run. The decode
loop is a single `lax.scan`, compiled once.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model import decoding
from plumbing.errors import UserError


def generate(config: Any, params: Any, prompt_ids: Sequence[int], *, max_new_tokens: int,
             temperature: float = 0.8, seed: int = 0, stop_id: Optional[int] = None
             ) -> list[int]:
  """New token ids continuing `prompt_ids` (one sequence), stopping after `stop_id`.

  Args:
    config: the ModelConfig.
    params: model parameters.
    prompt_ids: the prompt's token ids (at least one).
    max_new_tokens: how many tokens to draw at most.
    temperature: softmax temperature; 0 picks the most likely token.
    seed: sampling seed.
    stop_id: end-of-sequence id; generation output is cut after it.
  """
  if not len(prompt_ids):
    raise UserError("The prompt is empty: give at least one character")
  if max_new_tokens < 1:
    raise UserError(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
  if temperature < 0:
    raise UserError(f"--temperature must be >= 0, got {temperature}")
  prompt = jnp.asarray(prompt_ids, jnp.int32)[None]
  length = prompt.shape[1]
  cache = None
  if config.attention_window is None and "attention" in config.block_pattern:
    cache = decoding.init_cache(config, 1, jnp.dtype(config.dtype),
                                max_length=length + max_new_tokens)

  def pick(logits, key):
    if temperature == 0:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)

  @jax.jit
  def run(params, prompt, cache, key):
    logits, cache = decoding.prefill(config, params, prompt,
                                     jnp.arange(length, dtype=jnp.int32)[None], cache)
    first_key, key = jax.random.split(key)
    token = pick(logits[:, -1], first_key)

    def step(carry, index):
      token, cache, key = carry
      key, draw = jax.random.split(key)
      logits, cache = decoding.decode_step(config, params, token[:, None],
                                           jnp.full((1, 1), length + index, jnp.int32),
                                           cache)
      next_token = pick(logits[:, -1], draw)
      return (next_token, cache, key), token[0]

    _, tokens = jax.lax.scan(step, (token, cache, key),
                             jnp.arange(max_new_tokens, dtype=jnp.int32))
    return tokens

  tokens = [int(t) for t in jax.device_get(run(params, prompt, cache, jax.random.key(seed)))]
  if stop_id is not None and stop_id in tokens:
    tokens = tokens[:tokens.index(stop_id) + 1]
  return tokens


def sample_text(config: Any, params: Any, vocabulary: Any, prompt: str, *,
                max_new_tokens: int, temperature: float = 0.8, seed: int = 0) -> str:
  """The decoded continuation of `prompt` (without the prompt)."""
  ids = generate(config, params, np.asarray(vocabulary.encode(prompt), np.int32),
                 max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                 stop_id=vocabulary.eos_id)
  if ids and ids[-1] == vocabulary.eos_id:
    ids = ids[:-1]
  return vocabulary.decode(ids)
