"""lm-evaluation-harness's `LM` over this framework's JAX model.

`JaxLM(runtime, params, vocabulary, max_length=...)` answers lm_eval's three kinds of
request from any parameters: a checkpoint's (`pretrain.load`) or a training run's live
ones (`TrainConfig.downstream_tasks`). `pretrain.evaluation.downstream` drives lm_eval with it.

Scores mirror training, so they mean what the training loss means. The packer starts
every document, and every row-sized piece of a long one, with input 0 at position 0, and
the model predicts each token from the ones before (`pretrain.data.packing`); a request
is laid out the same way:
  loglikelihood(context, continuation): the row [0, context, continuation] and the sum
    of the log-softmax of the continuation's tokens (is_greedy: each one is the arg-max).
    A row longer than `max_length` keeps its last `max_length` tokens after the 0: the
    left-truncated window lm_eval's hf backend scores. An empty context is the row
    [0, continuation].
  loglikelihood_rolling(text): every token of the text given its whole prefix, in
    `max_length` chunks that carry the decoding caches, as `pretrain.evaluation.loss.text_loss`
    scores a file (without its EOS), so no token is scored twice or without context.
  generate_until(context, {until, max_gen_toks}): greedy decoding through the caches
    (`model.decoding`) from the row [0, last max_length - 1 tokens of the context],
    stopping at EOS or at the first stop sequence, which is cut from the text.

Shapes: rows are padded to a few bucketed lengths (`bucket_lengths`: powers of two and
their midpoints up to `max_length`), and batches to `batch_size` rows (a multiple of the
mesh's batch shards), so a whole harness run compiles a handful of programs. Batches are global arrays sharded over the
mesh's batch axes like training batches; the parameters stay in their own layout
(`runtime.param_shardings`, as loaded or trained). On several hosts every process runs
every request on the same host data, each feeding its own rows of the global batch
(lm_eval's rank and world size stay 0 and 1), and every process gets the same results.
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
from lm_eval.api.model import LM
import numpy as np

from model import decoding
from plumbing.errors import UserError
from pretrain.observability import metrics as metrics_lib
from pretrain.losses import token_losses
from pretrain.runtime import Runtime
from sharding import partition

DOCUMENT_START = 0      # the input at position 0 of every packed row
SMALLEST_BUCKET = 16
DECODE_CHUNK = 32       # greedy steps per decode call; stop sequences are checked between
DEFAULT_MAX_GEN_TOKS = 256  # lm_eval's hf backend default


def bucket_lengths(max_length: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
  """The padded lengths: `smallest`, then alternately ×1.5 and ×4/3 (16, 24, 32, 48, 64,
  96, ...: powers of two and the midpoints between them) below `max_length`, then it.

  A row pads by at most half its length (powers of two alone waste up to as much as
  they keep: 2x slower on requests just past a power), for about twice the programs:
  11 up to 512 tokens, 15 up to 2048.
  """
  lengths = []
  length = smallest
  while length < max_length:
    lengths.append(length)
    length = length * 3 // 2 if length & (length - 1) == 0 else length * 4 // 3
  return tuple(lengths) + (max_length,)


def batch_shards(runtime: Runtime) -> int:
  """How many shards a batch's rows are split into (the mesh axes of the `batch` rule)."""
  entry = partition.batch_spec(1, runtime.rules)[0]
  axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  return math.prod(runtime.mesh.shape[axis] for axis in axes)


def _row_scores(logits: jax.Array, targets: jax.Array, weights: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
  """Per row: the summed log-softmax of the weighted targets, and whether each of them
  is the arg-max."""
  nll, _ = token_losses(logits, targets)
  scored = weights > 0
  logprob = jnp.sum(jnp.where(scored, -nll, 0.0), axis=-1)
  greedy = jnp.all(~scored | (jnp.argmax(logits, axis=-1) == targets), axis=-1)
  return logprob, greedy


def _right_padded(rows: Sequence[tuple[Sequence[int], int]], batch_size: int,
                  length: int) -> dict[str, np.ndarray]:
  """[batch_size, length] inputs, targets, positions and weights of rows
  (tokens starting with DOCUMENT_START, how many last targets count), padded at the end
  (causality keeps the padding out of the real tokens' logits)."""
  inputs = np.zeros((batch_size, length), np.int32)
  targets = np.zeros((batch_size, length), np.int32)
  weights = np.zeros((batch_size, length), np.float32)
  for row, (tokens, scored) in enumerate(rows):
    n = len(tokens) - 1
    inputs[row, :n] = tokens[:-1]
    targets[row, :n] = tokens[1:]
    weights[row, n - scored:n] = 1.0
  positions = np.tile(np.arange(length, dtype=np.int32), (batch_size, 1))
  return {"inputs": inputs, "targets": targets, "positions": positions, "weights": weights}


def _host(x: jax.Array) -> np.ndarray:
  """A replicated array on this host (also when it spans several processes)."""
  return np.asarray(x.addressable_data(0))


class JaxLM(LM):
  """lm_eval's LM over a `Runtime`'s model (see the module docstring).

  Attributes:
    params: the parameters scored; the trainer swaps in each evaluation's.
    max_length: longest row scored or prompt decoded (the training sequence length).
    batch_size: rows per program call.
    max_gen_toks: new tokens per generation when a task does not say.
  """

  def __init__(self, runtime: Runtime, params: Any, vocabulary: Any, *, max_length: int,
               batch_size: int = 16, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
               progress: bool = False):
    """
    Args:
      runtime: model, mesh and shardings.
      params: parameters in `runtime.param_shardings`.
      vocabulary: a SeqIO vocabulary (`encode`, `decode`, `eos_id`).
      max_length: the model's length (tokens after the document-start input).
      batch_size: rows per batch, rounded up to a multiple of the batch shards.
      max_gen_toks: default new tokens of `generate_until`.
      progress: print progress lines on stderr (`pretrain.observability.metrics.with_progress`).
    """
    super().__init__()
    if max_length < 2:
      raise UserError(f"The model's length must be at least 2 tokens, got {max_length}")
    self.runtime = runtime
    self.params = params
    self.vocabulary = vocabulary
    self.max_length = max_length
    shards = batch_shards(runtime)
    self.batch_size = -(-max(batch_size, 1) // shards) * shards
    self.max_gen_toks = max_gen_toks
    self._progress = progress
    self._buckets = bucket_lengths(max_length)
    self._score = jax.jit(self._forward_scores, out_shardings=runtime.replicated)
    self._chunk = jax.jit(self._chunk_scores, static_argnames="cache_length")
    self._prefill = jax.jit(self._prefill_greedy, static_argnames="cache_length")
    self._decode = jax.jit(self._decode_greedy, static_argnames="steps")

  # lm_eval's API -------------------------------------------------------------------

  def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
    """(log-probability, is_greedy) of each request's (context, continuation)."""
    rows = [self._loglikelihood_row(*request.args) for request in requests]
    results: list[Any] = [None] * len(rows)
    for batch in self._batches(rows, lambda row: len(row[0]), "loglikelihood requests"):
      length = self._padded(max(len(rows[i][0]) - 1 for i in batch))
      arrays = _right_padded([rows[i] for i in batch], self.batch_size, length)
      with self.runtime.activation_context():
        logprob, greedy = self._score(self.params, self._global(arrays))
      logprob, greedy = _host(logprob), _host(greedy)
      for row, i in enumerate(batch):
        results[i] = (float(logprob[row]), bool(greedy[row]))
    return results

  def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
    """Log-probability of each request's text, every token given its whole prefix."""
    documents = [self._encode(request.args[0]) for request in requests]
    results = [0.0] * len(documents)
    for batch in self._batches(documents, len, "loglikelihood_rolling requests"):
      longest = max(len(documents[i]) for i in batch)
      chunk = self._padded(min(max(longest, 1), self.max_length))
      total = max(1, -(-longest // chunk)) * chunk
      arrays = _right_padded([([DOCUMENT_START] + documents[i], len(documents[i]))
                              for i in batch], self.batch_size, total)
      sums = np.zeros(self.batch_size)
      cache = None
      with self.runtime.activation_context():
        for start in range(0, total, chunk):
          part = {name: array[:, start:start + chunk] for name, array in arrays.items()}
          logprob, cache = self._chunk(self.params, cache, self._global(part),
                                       cache_length=self._cache_length(total))
          sums += _host(logprob)
      for row, i in enumerate(batch):
        results[i] = float(sums[row])
    return results

  def generate_until(self, requests: list[Any]) -> list[str]:
    """Greedy continuation of each request's context, cut at its stop sequences."""
    results = [""] * len(requests)
    groups: dict[str, list[int]] = {}
    for i, request in enumerate(requests):
      groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str),
                        []).append(i)
    for members in groups.values():
      until, max_new = self._generation_settings(requests[members[0]].args[1])
      if max_new < 1:
        continue
      prompts = [[DOCUMENT_START] + self._encode(requests[i].args[0])[-(self.max_length - 1):]
                 for i in members]
      for batch in self._batches(prompts, len, "generate_until requests"):
        texts = self._greedy([prompts[i] for i in batch], max_new, until)
        for text, i in zip(texts, batch):
          results[members[i]] = text
    return results

  # Requests to rows ----------------------------------------------------------------

  def _encode(self, text: str) -> list[int]:
    return [int(token) for token in self.vocabulary.encode(text)]

  def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm_eval's split of a pair into tokens: trailing spaces of the context move to the
    continuation, whose tokens are those of the whole text after the context's, so a
    tokenizer that merges across the boundary scores the tokens it would produce."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = self._encode(context)
    return context_ids, self._encode(context + continuation)[len(context_ids):]

  def _loglikelihood_row(self, context: str, continuation: str) -> tuple[list[int], int]:
    """(tokens starting with the document start, how many last ones are scored)."""
    context_ids, continuation_ids = self._encode_pair(context, continuation)
    if len(continuation_ids) > self.max_length:
      raise UserError(f"A continuation of {len(continuation_ids)} tokens is longer than "
                      f"the model's length ({self.max_length}): it cannot be scored")
    sequence = (context_ids + continuation_ids)[-self.max_length:]
    return [DOCUMENT_START] + sequence, len(continuation_ids)

  def _generation_settings(self, kwargs: dict[str, Any]) -> tuple[list[str], int]:
    """(stop sequences, new tokens) of a request's generation arguments."""
    if kwargs.get("do_sample"):
      raise UserError("This backend decodes greedily; the task asks for do_sample=True")
    until = kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    return until, int(kwargs.get("max_gen_toks", self.max_gen_toks))

  def _cache_length(self, tokens: int) -> Optional[int]:
    """The decoding cache's length for `tokens` in all: global attention keeps every
    token; local attention and recurrences keep a fixed-size state (None), so their
    programs do not depend on it."""
    return tokens if self.runtime.config.attention_window is None else None

  def _padded(self, length: int) -> int:
    return next(bucket for bucket in self._buckets if bucket >= length)

  def _batches(self, items: Sequence[Any], length: Callable[[Any], int], label: str
               ) -> Iterable[list[int]]:
    """Indices of `items` in batches, longest first, so similar lengths share a shape."""
    order = sorted(range(len(items)), key=lambda i: -length(items[i]))
    batches = [order[start:start + self.batch_size]
               for start in range(0, len(order), self.batch_size)]
    if self._progress and batches:
      return metrics_lib.with_progress(batches, len(batches), f"{label} (batches)")
    return batches

  def _global(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows of full host arrays, as global batch-sharded arrays."""
    rows = self.runtime.process_batch_rows(self.batch_size)
    return partition.make_global_batch(
        self.runtime.mesh, {name: array[rows] for name, array in arrays.items()},
        self.runtime.rules)

  # Generation ----------------------------------------------------------------------

  def _greedy(self, prompts: Sequence[Sequence[int]], max_new: int, until: Sequence[str]
              ) -> list[str]:
    """Texts decoded greedily after each prompt, in DECODE_CHUNK steps per call until
    every row has stopped or `max_new` tokens are out.

    Prompts are padded on the left, each pad token at position 0: a document of its own,
    which the prompt's own start (input 0 at position 0) closes, so no block sees it.
    """
    length = self._padded(max(len(prompt) for prompt in prompts))
    tokens = np.zeros((self.batch_size, length), np.int32)
    positions = np.zeros((self.batch_size, length), np.int32)
    next_position = np.zeros(self.batch_size, np.int32)
    for row, prompt in enumerate(prompts):
      tokens[row, length - len(prompt):] = prompt
      positions[row, length - len(prompt):] = np.arange(len(prompt))
      next_position[row] = len(prompt)
    steps = min(DECODE_CHUNK, max_new)
    cache_length = self._cache_length(length + -(-max_new // steps) * steps)
    generated = np.zeros((self.batch_size, 0), np.int32)
    with self.runtime.activation_context():
      token, cache = self._prefill(
          self.params, self._global({"inputs": tokens, "positions": positions}),
          cache_length=cache_length)
      position = self._global({"positions": next_position})["positions"]
      while generated.shape[1] < max_new and not all(
          self._text(generated[row], until)[1] for row in range(len(prompts))):
        emitted, token, position, cache = self._decode(self.params, token, position, cache,
                                                       steps=steps)
        generated = np.concatenate([generated, _host(emitted)], axis=1)
    return [self._text(generated[row, :max_new], until)[0] for row in range(len(prompts))]

  def _text(self, ids: np.ndarray, until: Sequence[str]) -> tuple[str, bool]:
    """(text of `ids` before EOS and before the first stop sequence, whether it stopped)."""
    ids = [int(token) for token in ids]
    stopped = self.vocabulary.eos_id in ids
    if stopped:
      ids = ids[:ids.index(self.vocabulary.eos_id)]
    text = self.vocabulary.decode(ids)
    cut = min((text.index(stop) for stop in until if stop and stop in text),
              default=None)
    if cut is None:
      return text, stopped
    return text[:cut], True

  # Device programs -----------------------------------------------------------------

  def _forward_scores(self, params: Any, batch: dict[str, jax.Array]
                      ) -> tuple[jax.Array, jax.Array]:
    logits, _ = self.runtime.model.apply({"params": params}, batch["inputs"],
                                         batch["positions"])
    return _row_scores(logits, batch["targets"], batch["weights"])

  def _replicated(self, x: jax.Array) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, self.runtime.replicated)

  def _new_cache(self, batch_size: int, cache_length: Optional[int]) -> dict:
    config = self.runtime.config
    return decoding.init_cache(config, batch_size, jnp.dtype(config.dtype),
                               max_length=cache_length)

  def _chunk_scores(self, params: Any, cache: Optional[dict], batch: dict[str, jax.Array],
                    cache_length: Optional[int]) -> tuple[jax.Array, dict]:
    """A chunk's summed log-probabilities per row, continuing `cache` (None: a fresh
    one, built here so that it takes the batch's sharding)."""
    if cache is None:
      cache = self._new_cache(batch["inputs"].shape[0], cache_length)
    logits, cache = decoding.prefill(self.runtime.config, params, batch["inputs"],
                                     batch["positions"], cache)
    logprob, _ = _row_scores(logits, batch["targets"], batch["weights"])
    return self._replicated(logprob), cache

  def _prefill_greedy(self, params: Any, batch: dict[str, jax.Array],
                      cache_length: Optional[int]) -> tuple[jax.Array, dict]:
    """The prompts' filled cache and each row's first new token."""
    cache = self._new_cache(batch["inputs"].shape[0], cache_length)
    logits, cache = decoding.prefill(self.runtime.config, params, batch["inputs"],
                                     batch["positions"], cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

  def _decode_greedy(self, params: Any, token: jax.Array, position: jax.Array, cache: dict,
                     steps: int) -> tuple[jax.Array, jax.Array, jax.Array, dict]:
    """Emits `steps` tokens per row, starting with `token` at `position`: (emitted
    [B, steps] replicated, next token, its position, cache)."""
    config = self.runtime.config

    def step(carry, _):
      token, position, cache = carry
      logits, cache = decoding.decode_step(config, params, token[:, None],
                                           position[:, None], cache)
      next_token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
      return (next_token, position + 1, cache), token

    (token, position, cache), emitted = jax.lax.scan(
        step, (token, position, cache), None, length=steps)
    return self._replicated(emitted.T), token, position, cache
