r"""Synthetic-task accuracy at multiples of the training length: the library of
`python -m pretrain.extrapolation`.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pretrain.data import synthetic


LogitsFn = Callable[[np.ndarray, np.ndarray], jax.Array]


def document_batch(tokens: np.ndarray, mask: np.ndarray) -> Dict[str, np.ndarray]:
  """Unpacked rows (one document each) in the trainer's batch format."""
  inputs = np.zeros_like(tokens)
  inputs[:, 1:] = tokens[:, :-1]
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  return {"inputs": inputs.astype(np.int32), "targets": tokens.astype(np.int32),
          "positions": np.ascontiguousarray(positions), "weights": mask.astype(np.float32)}


@jax.jit
def _answer_metrics(logits: jax.Array, targets: jax.Array, weights: jax.Array):
  """Per row: (summed NLL, correct answers, answers) over the weighted positions."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return (jnp.sum(nll * weights, axis=1), jnp.sum(correct * weights, axis=1),
          jnp.sum(weights, axis=1))


def evaluate_multiple(logits_fn: LogitsFn, spec: synthetic.SyntheticSpec, multiple: int,
                      num_examples: int, tokens_per_batch: int) -> Dict[str, float]:
  """Loss, accuracy and exact match of `logits_fn` on the task at `multiple` x length."""
  tokens, mask = spec.examples("test", count=num_examples, length_multiple=multiple)
  rows = max(1, tokens_per_batch // tokens.shape[1])
  nll, correct, answers = [], [], []
  for start in range(0, num_examples, rows):
    batch = document_batch(tokens[start:start + rows], mask[start:start + rows])
    logits = logits_fn(batch["inputs"], batch["positions"])
    row_nll, row_correct, row_answers = _answer_metrics(
        logits, jnp.asarray(batch["targets"]), jnp.asarray(batch["weights"]))
    nll.append(np.asarray(row_nll))
    correct.append(np.asarray(row_correct))
    answers.append(np.asarray(row_answers))
  nll, correct, answers = map(np.concatenate, (nll, correct, answers))
  return {"multiple": multiple, "length": int(tokens.shape[1]),
          "loss": float(nll.sum() / answers.sum()),
          "accuracy": float(correct.sum() / answers.sum()),
          "exact_match": float(np.mean(correct == answers)),
          "examples": num_examples}


def evaluate_multiples(logits_fn: LogitsFn, spec: synthetic.SyntheticSpec,
                       multiples: Sequence[int], num_examples: int = 64,
                       tokens_per_batch: int = 16384) -> List[Dict[str, float]]:
  return [evaluate_multiple(logits_fn, spec, m, num_examples, tokens_per_batch)
          for m in multiples]


def format_table(results: Sequence[Dict[str, float]], title: str = "") -> str:
  lines = [title] if title else []
  lines += ["| multiple | length | loss | accuracy | exact match |",
            "| --- | --- | --- | --- | --- |"]
  for r in results:
    lines.append(f"| {r['multiple']}x | {r['length']} | {r['loss']:.4f} | "
                 f"{r['accuracy']:.3f} | {r['exact_match']:.3f} |")
  return "\n".join(lines)
