"""Synthetic memory probes as SeqIO tasks, generated from a seed with no files.

These tasks tell a correct recurrence from a subtly broken one cheaply (GateLoop §5.1,
Griffin §6.2): each probes one memory skill, the loss and the accuracy count only the
positions whose answer needs that skill, and a length multiple makes the same task
longer to test extrapolation (`pretrain.extrapolation`).

Every example is one document `tokens` with a 0/1 `loss_mask`: mask[t] = 1 where
predicting tokens[t] from tokens[:t] is part of the task. Id 0 is never a token
(it is padding and the "start" input of the pipeline). The tasks:

memory_horizon (GateLoop appendix A). Input numbers 0..4 with `resets` reset tokens at
  distinct random positions (never the first). The target at input position n is
  f(list) with `list` the numbers after the most recent reset up to and including
  position n (from the sequence start if no reset came yet). Our reading of the
  appendix's "alternating sum of products of pairs taken from opposite ends":
      f(l) = (l[0]*l[m-1] - l[1]*l[m-2] + l[2]*l[m-3] - ...) mod 50,
  pairs moving inwards from both ends with signs +, -, +, ...; when m is odd the middle
  element is added or subtracted with the sign the next pair would have had; Python's
  mod, so 0 <= f < 50; f([]) = 0. Tokens: number v is id v + 1 (inputs and outputs
  share the ids of 0..4), the reset token is id modulus + 1. The paper's model maps
  input n to output n; in our next-token framework a document interleaves them,
  x_1 y_1 x_2 y_2 ..., and the loss counts the y after every number input (not after
  resets, whose target f([]) = 0 is a convention). `length` counts the inputs (1024 in
  the paper), so a document holds 2 x length tokens. The model sees earlier answers;
  they do not make the task easier, since appending a number re-pairs the whole list.
selective_copying (Gu & Dao 2023; Griffin §6.2, appendix H). `length` tokens in all:
  a prompt of noise tokens with `num_data` data tokens (values 0..vocab_size-1) at
  random distinct positions, a separator, then the data tokens in order as the
  answer (the loss counts the answer).
  Ids: 1 noise, 2 separator, 3 + value.
induction_heads (Olsson et al. 2022; Griffin §6.2). `length` tokens: random tokens
  (values 0..vocab_size-1) with one trigger token somewhere, followed by a value X;
  the document ends with the trigger again and then X (the loss counts X).
  Ids: 1 trigger, 2 + value.
phonebook (Griffin §6.2, appendix H). `num_entries` distinct names (`name_length`
  letters from `num_letters`) with phone numbers (`number_length` digits), written
  `name : number ;`, then `? name :` for one of them and its number as the answer.
  Ids: 1 ':', 2 ';', 3 '?', 4..13 digits, 14.. letters. The document length follows
  from the sizes; the length multiple scales `num_entries`.

SeqIO features. Tasks whose mask is a contiguous answer at the end (copying, induction,
phonebook) are prefix-LM tasks (`inputs` = prompt, `targets` = answer), which the data
pipeline already packs with loss on `targets` only. memory_horizon has `targets` = the
whole document and a `loss_mask` feature with the interleaved mask.

Tasks are registered by Gin-configurable functions returning the registered name
(`DataPipeline.task = @induction_heads_task()`); the defaults above are registered on
import under the plain family names.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from etils import epy
import gin
import jax.numpy as jnp
import numpy as np

# SeqIO and TensorFlow load on first use (about 6 s): commands that only parse
# configs, print help or plan memory never touch them.
with epy.lazy_imports():
  import seqio
  import tensorflow as tf

Example = Tuple[np.ndarray, np.ndarray]  # tokens int32 [N, n], loss_mask uint8 [N, n]
_SPLIT_STREAMS = {"train": 0, "validation": 1, "test": 2}


# -- memory horizon ----------------------------------------------------------------------
def memory_compression(numbers) -> int:
  """GateLoop's target function on a list of numbers (see the module docstring)."""
  total, sign = 0, 1
  i, j = 0, len(numbers) - 1
  while i < j:
    total += sign * numbers[i] * numbers[j]
    sign, i, j = -sign, i + 1, j - 1
  if i == j:
    total += sign * numbers[i]
  return total


def _prefix_compressions(values: np.ndarray) -> np.ndarray:
  """memory_compression(values[:n]) for n = 1..m at once ([m] int64, before the mod).

  Pair i (sign (-1)^i) contributes values[i] * values[n-1-i] to every prefix n long
  enough to hold it distinct from its partner, n >= 2i + 2: one vector operation per
  pair index instead of one loop per prefix.
  """
  values = np.asarray(values, np.int64)
  m = len(values)
  out = np.zeros(m, np.int64)
  for i in range(m // 2):
    sign = 1 if i % 2 == 0 else -1
    out[2 * i + 1:] += sign * values[i] * values[i + 1:m - i]
  middle = values[:(m + 1) // 2]                  # prefix 2k + 1 has middle element k
  out[0::2] += np.where(np.arange(len(middle)) % 2 == 0, middle, -middle)
  return out


def memory_horizon_examples(rng: np.random.Generator, count: int, length: int,
                            resets: int, max_input: int, modulus: int) -> Example:
  if resets >= length:
    raise ValueError(f"memory_horizon: resets={resets} must be < length={length}")
  reset_id = modulus + 1
  tokens = np.zeros((count, 2 * length), np.int32)
  mask = np.zeros((count, 2 * length), np.uint8)
  for e in range(count):
    numbers = rng.integers(0, max_input + 1, size=length)
    is_reset = np.zeros(length, bool)
    is_reset[rng.choice(np.arange(1, length), size=resets, replace=False)] = True
    answers = np.zeros(length, np.int64)
    starts = np.concatenate([[0], np.flatnonzero(is_reset)])
    ends = np.concatenate([np.flatnonzero(is_reset), [length]])
    for start, end in zip(starts, ends):
      first = start + 1 if is_reset[start] else start
      if end > first:
        answers[first:end] = _prefix_compressions(numbers[first:end]) % modulus
    tokens[e, 0::2] = np.where(is_reset, reset_id, numbers + 1)
    tokens[e, 1::2] = answers + 1
    mask[e, 1::2] = ~is_reset
  return tokens, mask


# -- selective copying -------------------------------------------------------------------
def selective_copying_examples(rng: np.random.Generator, count: int, length: int,
                               num_data: int, vocab_size: int) -> Example:
  prompt_length = length - num_data - 1
  if prompt_length < num_data:
    raise ValueError(f"selective_copying: length={length} leaves no room for "
                     f"{num_data} data tokens among noise and their copy")
  values = rng.integers(0, vocab_size, size=(count, num_data))
  # Distinct sorted positions per row: the first num_data of a random permutation.
  positions = np.sort(np.argsort(rng.random((count, prompt_length)), axis=1)[:, :num_data],
                      axis=1)
  tokens = np.ones((count, length), np.int32)                     # noise
  np.put_along_axis(tokens[:, :prompt_length], positions, values + 3, axis=1)
  tokens[:, prompt_length] = 2                                     # separator
  tokens[:, prompt_length + 1:] = values + 3
  mask = np.zeros((count, length), np.uint8)
  mask[:, prompt_length + 1:] = 1
  return tokens, mask


# -- induction heads ---------------------------------------------------------------------
def induction_heads_examples(rng: np.random.Generator, count: int, length: int,
                             vocab_size: int) -> Example:
  if length < 5:
    raise ValueError(f"induction_heads: length={length} must be >= 5")
  tokens = rng.integers(0, vocab_size, size=(count, length)).astype(np.int32) + 2
  # Trigger then X somewhere before the final trigger, which must not directly follow.
  trigger_at = rng.integers(0, length - 4, size=count)
  rows = np.arange(count)
  tokens[rows, trigger_at] = 1
  tokens[:, -2] = 1
  tokens[:, -1] = tokens[rows, trigger_at + 1]
  mask = np.zeros((count, length), np.uint8)
  mask[:, -1] = 1
  return tokens, mask


# -- phonebook ---------------------------------------------------------------------------
_COLON, _SEMICOLON, _QUERY, _DIGIT0, _LETTER0 = 1, 2, 3, 4, 14


def phonebook_examples(rng: np.random.Generator, count: int, num_entries: int,
                       name_length: int, number_length: int, num_letters: int) -> Example:
  if num_entries > num_letters ** name_length:
    raise ValueError(f"phonebook: {num_entries} entries need more distinct names than "
                     f"{num_letters}^{name_length}; raise name_length or num_letters")
  entry = name_length + 1 + number_length + 1
  length = num_entries * entry + 1 + name_length + 1 + number_length
  tokens = np.zeros((count, length), np.int32)
  mask = np.zeros((count, length), np.uint8)
  mask[:, -number_length:] = 1
  for e in range(count):
    codes = rng.choice(num_letters ** name_length, size=num_entries, replace=False)
    names = (codes[:, None] // num_letters ** np.arange(name_length)) % num_letters
    numbers = rng.integers(0, 10, size=(num_entries, number_length))
    book = np.concatenate([names + _LETTER0, np.full((num_entries, 1), _COLON),
                           numbers + _DIGIT0, np.full((num_entries, 1), _SEMICOLON)], 1)
    asked = rng.integers(num_entries)
    tokens[e] = np.concatenate([book.ravel(), [_QUERY], names[asked] + _LETTER0, [_COLON],
                                numbers[asked] + _DIGIT0])
  return tokens, mask


# -- task specifications -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
  """One synthetic task: its family, parameters and split sizes.

  Attributes:
    family: "memory_horizon", "selective_copying", "induction_heads" or "phonebook".
    params: the generator's keyword arguments (lengths and vocabulary sizes).
    num_train: examples in the train split.
    num_validation: examples in the validation split.
    seed: the generator seed (each split and length multiple draws its own stream).
  """
  family: str
  params: Tuple[Tuple[str, Any], ...]
  num_train: int
  num_validation: int
  seed: int

  @property
  def kwargs(self) -> Dict[str, Any]:
    return dict(self.params)

  @property
  def vocab_size(self) -> int:
    return FAMILIES[self.family].vocab_size(self.kwargs)

  @property
  def document_length(self) -> int:
    tokens, _ = self.examples("train", count=1)
    return tokens.shape[1]

  def scaled(self, multiple: int) -> Dict[str, Any]:
    """Generator arguments for documents `multiple` times as long."""
    return FAMILIES[self.family].scale(self.kwargs, multiple)

  def examples(self, split: str, count: Optional[int] = None,
               length_multiple: int = 1) -> Example:
    """Examples of a split, deterministic in (seed, split, length_multiple)."""
    if split not in _SPLIT_STREAMS:
      raise ValueError(f"unknown split {split!r}; expected one of {sorted(_SPLIT_STREAMS)}")
    if count is None:
      count = self.num_train if split == "train" else self.num_validation
    rng = np.random.default_rng([self.seed, _SPLIT_STREAMS[split], length_multiple])
    return FAMILIES[self.family].generate(rng, count, **self.scaled(length_multiple))


@dataclasses.dataclass(frozen=True)
class _Family:
  generate: Callable[..., Example]
  vocab_size: Callable[[Mapping[str, Any]], int]
  scale: Callable[[Mapping[str, Any], int], Dict[str, Any]]
  prefix_lm: bool


def _scale_key(*keys):
  return lambda p, m: {**p, **{k: p[k] * m for k in keys}}


FAMILIES: Dict[str, _Family] = {
    # Longer sequences keep the mean distance between resets: more resets, same task.
    "memory_horizon": _Family(memory_horizon_examples, lambda p: p["modulus"] + 2,
                              _scale_key("length", "resets"), prefix_lm=False),
    # Longer sequences keep the number of data tokens: more noise between them.
    "selective_copying": _Family(selective_copying_examples, lambda p: p["vocab_size"] + 3,
                                 _scale_key("length"), prefix_lm=True),
    "induction_heads": _Family(induction_heads_examples, lambda p: p["vocab_size"] + 2,
                               _scale_key("length"), prefix_lm=True),
    "phonebook": _Family(phonebook_examples, lambda p: _LETTER0 + p["num_letters"],
                         _scale_key("num_entries"), prefix_lm=True),
}

SPECS: Dict[str, SyntheticSpec] = {}
# The spec each name was last put into SeqIO's registry with.
_IN_SEQIO: Dict[str, SyntheticSpec] = {}


def _dataset_fn(split: str, shuffle_files: bool = False, seed: Optional[int] = None, *,
                spec: SyntheticSpec) -> tf.data.Dataset:
  """SeqIO dataset function: the split's examples as int32 features."""
  del shuffle_files, seed  # the content is fixed by the spec's own seed
  tokens, mask = spec.examples(split)
  if FAMILIES[spec.family].prefix_lm:
    answer = int(np.argmax(mask[0]))  # every example's answer starts at the same index
    features = {"inputs": tokens[:, :answer], "targets": tokens[:, answer:]}
  else:
    features = {"targets": tokens, "loss_mask": mask.astype(np.int32)}
  # Variable-length signatures: documents are variable-length sequences for SeqIO and
  # the packer (a static length would make tf.data batch them as dense tensors).
  signature = {k: tf.TensorSpec([None], tf.int32) for k in features}
  return tf.data.Dataset.from_generator(
      lambda: ({k: v[e] for k, v in features.items()} for e in range(len(tokens))),
      output_signature=signature)


def register(family: str, name: Optional[str] = None, *, num_train: int,
             num_validation: int, seed: int, **params) -> str:
  """Describes a synthetic task (replacing one of the same name); returns its name.

  The SeqIO task itself is built by `add_to_seqio`, which the data pipeline calls
  before it looks a task up, so registering (the four defaults below happen on import)
  does not load TensorFlow.
  """
  if family not in FAMILIES:
    raise ValueError(f"unknown synthetic task family {family!r}; "
                     f"expected one of {sorted(FAMILIES)}")
  if num_train < 1 or num_validation < 1:
    raise ValueError(f"{family}: num_train={num_train} and num_validation="
                     f"{num_validation} must both be >= 1")
  spec = SyntheticSpec(family, tuple(sorted(params.items())), num_train, num_validation,
                       seed)
  spec.examples("validation", count=1)  # fails now, with the generator's message
  if name is None:
    key = json.dumps([spec.params, num_train, num_validation, seed])
    name = f"{family}_{hashlib.sha256(key.encode()).hexdigest()[:10]}"
  SPECS[name] = spec
  return name


def _seqio_task(name: str, spec: SyntheticSpec) -> seqio.Task:
  vocabulary = seqio.PassThroughVocabulary(spec.vocab_size)
  features = {"targets": seqio.Feature(vocabulary, add_eos=False, dtype=tf.int32)}
  if FAMILIES[spec.family].prefix_lm:
    features["inputs"] = seqio.Feature(vocabulary, add_eos=False, dtype=tf.int32)
  else:
    features["loss_mask"] = seqio.Feature(seqio.PassThroughVocabulary(2), add_eos=False,
                                          dtype=tf.int32)
  source = seqio.FunctionDataSource(
      functools.partial(_dataset_fn, spec=spec), splits=("train", "validation"),
      num_input_examples={"train": spec.num_train, "validation": spec.num_validation})
  return seqio.Task(name, source=source, output_features=features, preprocessors=[],
                    shuffle_buffer_size=None)


def add_to_seqio() -> None:
  """Puts every described task into SeqIO's registry (a changed one replaces the old)."""
  for name, spec in SPECS.items():
    if _IN_SEQIO.get(name) == spec:
      continue
    if name in seqio.TaskRegistry.names():
      seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add_provider(name, _seqio_task(name, spec))
    _IN_SEQIO[name] = spec


def spec_of(task_name: str) -> SyntheticSpec:
  """The specification of a registered synthetic task, or an error naming the known ones."""
  if task_name not in SPECS:
    raise ValueError(f"{task_name!r} is not a registered synthetic task; known: "
                     f"{sorted(SPECS)} (tasks configured in Gin are registered when "
                     "their `*_task()` function runs)")
  return SPECS[task_name]


# -- Gin-configurable registrations ------------------------------------------------------
@gin.configurable
def memory_horizon_task(length: int = 1024, resets: int = 3, max_input: int = 4,
                        modulus: int = 50, num_train: int = 2000,
                        num_validation: int = 200, seed: int = 0,
                        name: Optional[str] = None) -> str:
  """GateLoop's memory-horizon task (paper defaults: 2000 samples of 1024 inputs)."""
  return register("memory_horizon", name, num_train=num_train,
                  num_validation=num_validation, seed=seed, length=length, resets=resets,
                  max_input=max_input, modulus=modulus)


@gin.configurable
def selective_copying_task(length: int = 1024, num_data: int = 16, vocab_size: int = 16,
                           num_train: int = 10000, num_validation: int = 200,
                           seed: int = 0, name: Optional[str] = None) -> str:
  """Selective copying (Griffin appendix H sizes: vocabulary 16, length 1024, 16 tokens)."""
  return register("selective_copying", name, num_train=num_train,
                  num_validation=num_validation, seed=seed, length=length,
                  num_data=num_data, vocab_size=vocab_size)


@gin.configurable
def induction_heads_task(length: int = 256, vocab_size: int = 16, num_train: int = 10000,
                         num_validation: int = 200, seed: int = 0,
                         name: Optional[str] = None) -> str:
  """Induction heads (Griffin appendix H sizes: vocabulary 16, length 256)."""
  return register("induction_heads", name, num_train=num_train,
                  num_validation=num_validation, seed=seed, length=length,
                  vocab_size=vocab_size)


@gin.configurable
def phonebook_task(num_entries: int = 20, name_length: int = 3, number_length: int = 4,
                   num_letters: int = 26, num_train: int = 10000,
                   num_validation: int = 200, seed: int = 0,
                   name: Optional[str] = None) -> str:
  """Phonebook lookup: find the number of a queried name in an in-context phonebook."""
  return register("phonebook", name, num_train=num_train, num_validation=num_validation,
                  seed=seed, num_entries=num_entries, name_length=name_length,
                  number_length=number_length, num_letters=num_letters)


memory_horizon_task(name="memory_horizon")
selective_copying_task(name="selective_copying")
induction_heads_task(name="induction_heads")
phonebook_task(name="phonebook")


# -- metrics -----------------------------------------------------------------------------
def accuracy_sums(logits, targets, weights) -> Tuple[Any, Any]:
  """(weighted count of correct arg-max predictions, sum of weights); jit-friendly.

  Summed over batches, their ratio is the accuracy of a whole evaluation.
  """
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  weights = jnp.asarray(weights, jnp.float32)
  return jnp.sum(correct * weights), jnp.sum(weights)


def target_accuracy(logits, targets, weights) -> float:
  """Fraction of the weighted positions whose arg-max prediction is the target.

  Args:
    logits: [B, T, V] scores.
    targets: int [B, T].
    weights: [B, T], nonzero where the position is an answer of the task.
  """
  correct, total = accuracy_sums(logits, targets, weights)
  if float(total) <= 0:
    raise ValueError("target_accuracy: the weights select no position")
  return float(correct) / float(total)
