"""The training objective: next-token NLL with an optional z-loss, as weighted sums.

Sums (not means) make microbatch accumulation and multi-batch evaluation exact: the big
batch's mean is the sum over parts divided by the summed weights, and so is its gradient.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from model.lm import LanguageModel


def token_losses(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-token negative log-likelihood and log-normaliser, in float32."""
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return log_z - target_logit, log_z


def loss_sums(model: LanguageModel, params: Any, batch: Mapping[str, jax.Array],
              z_loss_weight: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Summed objective over a batch, and its parts {nll_sum, z_sum, weight_sum}.

  The z-loss, mean(log Z ²), keeps the softmax normaliser near 1.
  """
  logits, _ = model.apply({"params": params}, batch["inputs"], batch["positions"])
  nll, log_z = token_losses(logits, batch["targets"])
  weights = batch["weights"].astype(jnp.float32)
  nll_sum = jnp.sum(nll * weights)
  z_sum = jnp.sum(jnp.square(log_z) * weights)
  objective = nll_sum + z_loss_weight * z_sum
  return objective, {"nll_sum": nll_sum, "z_sum": z_sum, "weight_sum": jnp.sum(weights)}
