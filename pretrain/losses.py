"""The training objective: next-token NLL with an optional z-loss, as weighted sums.

Sums (not means) make microbatch accumulation and multi-batch evaluation exact: the big
batch's mean is the sum over parts divided by the summed weights, and so is its gradient.

Large vocabularies: the plain loss holds float32 logits [B, T, V] (8 GiB per sequence
for RecurrentGemma's 256,000 tokens at T = 8192), and its backward another buffer of
that size. With `loss_chunks = n > 1` the logits are formed n token-chunks at a time
inside a `lax.scan` whose body is rematerialised, so forward and backward hold one
chunk's [B, T/n, V] logits; the values are the same numbers computed in pieces. Chunk k
takes the tokens t = k (mod n): strided, so every chunk has T/n tokens from each shard
of a sequence-split mesh and the time sharding survives without moving data.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.lm import LanguageModel, output_logits


def token_losses(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-token negative log-likelihood and log-normaliser, in float32."""
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return log_z - target_logit, log_z


def chunked_token_losses(config: ModelConfig, embedding: jax.Array, hidden: jax.Array,
                         targets: jax.Array, chunks: int) -> tuple[jax.Array, jax.Array]:
  """`token_losses(output_logits(config, embedding, hidden), targets)`, `chunks` at a time.

  Args:
    config: the model (soft cap of the logits).
    embedding: the tied [V, D] table.
    hidden: final normalised states [B, T, D] (`LanguageModel(return_hidden=True)`).
    targets: int [B, T].
    chunks: token chunks (strided, see the module docstring); must divide T.

  Returns:
    (nll, log_z), float32 [B, T], as `token_losses` gives them.
  """
  batch, length, width = hidden.shape
  if length % chunks:
    raise ValueError(f"loss_chunks={chunks} must divide the sequence length {length}")
  # [B, T, ...] -> [chunks, B, T/chunks, ...]: chunk k holds tokens k, k + chunks, ...
  split = lambda v: jnp.moveaxis(v.reshape(batch, length // chunks, chunks, *v.shape[2:]),
                                 2, 0)

  @jax.checkpoint
  def one_chunk(table, h, t):
    return token_losses(output_logits(config, table, h), t)

  _, (nll, log_z) = jax.lax.scan(
      lambda carry, chunk: (carry, one_chunk(embedding, *chunk)), None,
      (split(hidden), split(targets)))
  merge = lambda v: jnp.moveaxis(v, 0, 2).reshape(batch, length)
  return merge(nll), merge(log_z)


def loss_sums(model: LanguageModel, params: Any, batch: Mapping[str, jax.Array],
              z_loss_weight: float = 0.0, loss_chunks: int = 1
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Summed objective over a batch, and its parts {nll_sum, z_sum, weight_sum}.

  The z-loss, mean(log Z ²), keeps the softmax normaliser near 1. `loss_chunks > 1`
  forms the logits in that many token chunks (module docstring); same values.
  """
  if loss_chunks == 1:
    logits, _ = model.apply({"params": params}, batch["inputs"], batch["positions"])
    nll, log_z = token_losses(logits, batch["targets"])
  else:
    hidden, _ = model.apply({"params": params}, batch["inputs"], batch["positions"],
                            return_hidden=True)
    nll, log_z = chunked_token_losses(model.config, params["embedder"]["embedding"],
                                      hidden, batch["targets"], loss_chunks)
  weights = batch["weights"].astype(jnp.float32)
  nll_sum = jnp.sum(nll * weights)
  z_sum = jnp.sum(jnp.square(log_z) * weights)
  objective = nll_sum + z_loss_weight * z_sum
  return objective, {"nll_sum": nll_sum, "z_sum": z_sum, "weight_sum": jnp.sum(weights)}
