"""Scoring a model: mean NLL over batches, answer accuracy of synthetic tasks, and the
NLL of one long document scored chunk by chunk through the decoding caches."""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from model import decoding
from plumbing.errors import UserError
from pretrain.data import synthetic
from pretrain.losses import token_losses
from pretrain.runtime import Runtime, host_scalar
from pretrain.steps import make_eval_step


def jit_eval_step(runtime: Runtime, byte_lengths: Optional[np.ndarray] = None
                  ) -> Callable:
  """The eval step compiled for the runtime's shardings: (params, batch) -> sums.

  `byte_lengths` (`pretrain.data.vocabularies.token_byte_lengths`; None: no byte count)
  is put on the devices once, replicated, and passed to every call rather than folded
  into the program as a constant (a 256k-piece vocabulary's table is about 1 MB).
  """
  step = jax.jit(make_eval_step(runtime.model),
                 in_shardings=(runtime.param_shardings, runtime.batch_shardings(),
                               runtime.replicated),
                 out_shardings=runtime.replicated)
  table = (None if byte_lengths is None
           else jax.device_put(np.asarray(byte_lengths, np.int32), runtime.replicated))
  return lambda params, batch: step(params, batch, table)


def bits_per_byte(nats: float, num_bytes: float) -> float:
  """Summed NLL over the UTF-8 bytes of the scored text, in bits: unlike nats per
  token it does not depend on the vocabulary, so runs with different tokenizers compare."""
  return nats / (math.log(2) * num_bytes)


def _summed(runtime: Runtime, params: Any, batches: Iterable[Mapping[str, np.ndarray]],
            sums_fn: Callable) -> dict[str, float]:
  """Adds `sums_fn(params, batch)` over the batches, on device; host floats at the end."""
  totals = None
  with runtime.activation_context():
    for local in batches:
      part = sums_fn(params, runtime.global_batch(local))
      totals = part if totals is None else jax.tree.map(jnp.add, totals, part)
  if totals is None:
    raise UserError("The evaluation data produced no batch")
  return {name: host_scalar(value) for name, value in totals.items()}


def evaluate_batches(runtime: Runtime, params: Any,
                     batches: Iterable[Mapping[str, np.ndarray]],
                     eval_fn: Optional[Callable] = None) -> dict[str, float]:
  """{"loss" (mean next-token NLL, nats/token), "tokens", "bits_per_byte"} over `batches`.

  `eval_fn` is a `jit_eval_step` (default: one without a byte table). "bits_per_byte"
  is there only when it counted bytes and some were scored: a vocabulary without text
  has none, and the field is left out rather than written as NaN.
  """
  totals = _summed(runtime, params, batches, eval_fn or jit_eval_step(runtime))
  tokens = totals["weight_sum"]
  if tokens == 0:
    raise UserError("The evaluation data holds no tokens")
  result = {"loss": totals["nll_sum"] / tokens, "tokens": int(tokens)}
  if totals.get("byte_sum"):
    result["bits_per_byte"] = bits_per_byte(totals["nll_sum"], totals["byte_sum"])
  return result


def answer_metrics(runtime: Runtime, params: Any,
                   batches: Iterable[Mapping[str, np.ndarray]]) -> dict[str, float]:
  """{"loss", "tokens", "accuracy"} over `batches` of a synthetic task.

  The weights select the task's answer positions, so the loss and the arg-max accuracy
  (`synthetic.accuracy_sums`) both count those only; one forward pass gives both.
  """
  def sums(params, batch):
    logits, _ = runtime.model.apply({"params": params}, batch["inputs"], batch["positions"])
    nll, _ = token_losses(logits, batch["targets"])
    weights = batch["weights"].astype(jnp.float32)
    correct, total = synthetic.accuracy_sums(logits, batch["targets"], weights)
    return {"nll": jnp.sum(nll * weights), "correct": correct, "weight": total}

  sums_fn = jax.jit(sums, in_shardings=(runtime.param_shardings, runtime.batch_shardings()),
                    out_shardings=runtime.replicated)
  totals = _summed(runtime, params, batches, sums_fn)
  if totals["weight"] == 0:
    raise UserError("The evaluation data holds no answer position")
  return {"loss": totals["nll"] / totals["weight"], "tokens": int(totals["weight"]),
          "accuracy": totals["correct"] / totals["weight"]}


def text_loss(config: Any, params: Any, vocabulary: Any, text: str, chunk_length: int
              ) -> tuple[float, int]:
  """(mean NLL in nats/token, token count) of `text` scored as one document.

  Tokens are scored exactly as in training (the first one predicted from the
  document-start input 0, EOS last), in chunks of `chunk_length` that carry the decoding
  caches from chunk to chunk, so every token sees its whole prefix while memory stays
  bounded.
  """
  ids = list(vocabulary.encode(text))
  if not ids:
    raise UserError("The text file is empty: nothing to score")
  targets = np.asarray(ids + [vocabulary.eos_id], np.int32)
  inputs = np.concatenate([[0], targets[:-1]]).astype(np.int32)
  padded = -(-len(targets) // chunk_length) * chunk_length
  pad = padded - len(targets)
  weights = np.concatenate([np.ones(len(targets)), np.zeros(pad)]).astype(np.float32)
  inputs, targets = (np.pad(a, (0, pad)) for a in (inputs, targets))
  positions = np.arange(padded, dtype=np.int32)
  max_length = padded if config.attention_window is None else None
  cache = decoding.init_cache(config, 1, jnp.dtype(config.dtype), max_length=max_length)

  @jax.jit
  def chunk_sums(params, cache, tokens, positions, targets, weights):
    logits, cache = decoding.prefill(config, params, tokens, positions, cache)
    nll, _ = token_losses(logits, targets)
    return jnp.sum(nll * weights), cache

  total = 0.0
  for start in range(0, padded, chunk_length):
    part = slice(start, start + chunk_length)
    nll, cache = chunk_sums(params, cache, inputs[None, part], positions[None, part],
                            targets[None, part], weights[None, part])
    total += float(nll)
  count = len(ids) + 1
  return total / count, count
