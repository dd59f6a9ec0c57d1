"""The trainer's data: deterministic, resumable batches of packed rows from a SeqIO task.

`DataPipeline` materialises the task's train split once into a cached token store
(`token_store`), then serves `batch(step)`: this process's slice of the global batch at
`step`, a pure function of (seed, step, process_index, process_count) (`indexing`).
Nothing else needs saving to resume, and a run may resume on a different number of
processes.

Gin (see configs/data/*.gin):
  DataPipeline.task = @text_files_task()       # or any registered task/mixture name
  text_files_task.train_files = %TRAIN_FILES
The trainer passes `sequence_length`, `batch_size` and `seed` (from its TrainConfig, so
the data and the model never disagree), `process_index` and `process_count`.

A mixture named with `DataPipeline.task = @mixture()` (`mixing`) keeps one store per
task; `batch(step)` deals the global batch's rows over the tasks as a pure function of
(seed, step, weights), and `mixture_record(step)` reports the token share each task
got in the batches served since the last report (a `metrics.jsonl` row of kind
`mixture`).
"""
from __future__ import annotations

import os
from typing import Dict, Iterable, Iterator, Optional

from etils import epy
import gin
import numpy as np

from plumbing import storage
from plumbing.errors import EXIT_USAGE
from pretrain.data import indexing, materialize, mixing, token_store
from pretrain.data.errors import DataError
from pretrain.data.packing import features_from_rows
from pretrain.data.vocabularies import vocabulary_fingerprint

# SeqIO and TensorFlow load on first use (about 6 s): commands that only parse
# configs, print help or plan memory never touch them.
with epy.lazy_imports():
  import seqio

DEFAULT_CACHE_DIR = os.environ.get(
    "GRIFFIN_DATA_CACHE", os.path.join("~", ".cache", "griffin_pretrain", "tokens"))

Batch = Dict[str, np.ndarray]


@gin.configurable
class DataPipeline:
  """Batches for one process of a (possibly multi-process) training run.

  Attributes:
    task_name: the SeqIO task or mixture.
    vocabulary: the `targets` vocabulary (`vocab_size` ids; 0 = padding).
    train_store: the token store of the train split.
    rows_per_process: rows of each batch this process gets (batch_size / processes).
  """

  def __init__(self, task: str = gin.REQUIRED,
               sequence_length: int = gin.REQUIRED,
               batch_size: int = gin.REQUIRED,
               seed: int = 0,
               process_index: int = 0,
               process_count: int = 1,
               cache_dir: str = DEFAULT_CACHE_DIR,
               train_split: str = "train",
               validation_split: str = "validation",
               max_train_documents: Optional[int] = None,
               max_validation_documents: Optional[int] = None,
               build_missing: bool = True,
               open_validation: bool = False):
    """Builds (or reuses) the train token store, and the validation one if asked.

    Args:
      task: name of a registered SeqIO task or mixture, e.g. the value of
        `@text_files_task()`, `"c4_en"` or a synthetic task.
      sequence_length: T, tokens per row.
      batch_size: global batch size in rows, over all processes.
      seed: seeds the per-epoch row order (not the store's content).
      process_index: this process, in [0, process_count).
      process_count: processes sharing the global batch; must divide batch_size.
      cache_dir: where token stores are cached (`$GRIFFIN_DATA_CACHE` by default).
      train_split: the task split to train on.
      validation_split: the split `validation_batches` reads.
      max_train_documents: use only the first N documents of the train split
        (for huge corpora such as C4); None = all.
      max_validation_documents: likewise for the validation split.
      build_missing: build a missing store here (one machine, local cache); the
        trainer passes False when its processes span machines, where every host would
        otherwise tokenise the whole corpus itself. A `gs://` / `s3://` cache_dir is
        never built into: `python -m pretrain.data.prepare` writes it.
      open_validation: build or open the validation store now, so a run that will
        evaluate finds an empty or missing split before its first step rather than
        at its first evaluation (the trainer passes whether it evaluates).
    """
    if sequence_length < 1:
      raise DataError(f"SEQUENCE_LENGTH={sequence_length} must be >= 1")
    self.rows_per_process = indexing.check_batch_split(batch_size, process_count)
    if not 0 <= process_index < process_count:
      raise DataError(
          f"process_index={process_index} is outside [0, {process_count})")
    self.task_name = task
    self.sequence_length = sequence_length
    self.batch_size = batch_size
    self.seed = seed
    self.process_index = process_index
    self.process_count = process_count
    self._cache_dir = cache_dir
    self._build_missing = build_missing and not storage.is_url(cache_dir)
    self._validation_split = validation_split
    self._max_validation_documents = max_validation_documents
    self._mixture = mixing.lookup(task)
    task_names = self._mixture.tasks if self._mixture else (task,)
    self._providers = [materialize.get_provider(name) for name in task_names]
    self._provider = self._providers[0]
    self.vocabulary: seqio.Vocabulary = (
        self._provider.output_features["targets"].vocabulary)
    for provider in self._providers:
      if not materialize.has_split(provider, train_split):
        raise DataError(f"SeqIO task '{provider.name}' has no '{train_split}' split")
    self._check_mixable()
    self.train_stores = [self._store(provider, train_split, max_train_documents)
                         for provider in self._providers]
    self.train_store = self.train_stores[0]
    self._validation_store = None
    self._mixer = None
    if self._mixture:
      self._mixer = mixing.Mixer(
          self._mixture, batch_size,
          [s.metadata["num_tokens"] / max(s.num_rows, 1) for s in self.train_stores])
      self._served_tokens = np.zeros(len(self._providers), np.int64)
      self._served_rows = np.zeros(len(self._providers), np.int64)
    if open_validation:
      self.validation_store  # pylint: disable=pointless-statement

  def _check_mixable(self) -> None:
    """A mixture's tasks share a vocabulary and stored arrays."""
    if len(self._providers) < 2:
      return
    first = self._providers[0]
    for other in self._providers[1:]:
      if vocabulary_fingerprint(other.output_features["targets"].vocabulary) != (
          vocabulary_fingerprint(self.vocabulary)) or (
              materialize.has_loss_mask(other) != materialize.has_loss_mask(first)):
        raise DataError(
            f"mixture '{self.task_name}': task '{other.name}' has another vocabulary or "
            f"loss mask than '{first.name}'; give every task of a mixture the same "
            "vocabulary")

  @property
  def vocab_size(self) -> int:
    return self.vocabulary.vocab_size

  @property
  def num_train_rows(self) -> int:
    return sum(store.num_rows for store in self.train_stores)

  @property
  def steps_per_epoch(self) -> float:
    return self.num_train_rows / self.batch_size

  def batch(self, step: int) -> Batch:
    """This process's `[batch_size / process_count, T]` rows of global batch `step`."""
    if self._mixer is not None:
      return self._mixture_batch(step)
    rows = indexing.batch_rows(
        step, seed=self.seed, batch_size=self.batch_size,
        num_rows=self.num_train_rows, process_index=self.process_index,
        process_count=self.process_count)
    return features_from_rows(**self.train_store.read(rows))

  def _mixture_batch(self, step: int) -> Batch:
    indexing.check_batch_split(self.batch_size, self.process_count)
    if step < 0:
      raise DataError(f"step={step} must be >= 0")
    positions = (step * self.batch_size + self.process_index * self.rows_per_process
                 + np.arange(self.rows_per_process, dtype=np.int64))
    owners, indices = self._mixer.assign(positions)
    parts = {}
    for k in np.unique(owners):
      selected = owners == k
      store = self.train_stores[k]
      rows = mixing.stream_rows(indices[selected], store.num_rows,
                                mixing.task_seed(self.seed, int(k)))
      for name, array in store.read(rows).items():
        if name not in parts:
          parts[name] = np.zeros((self.rows_per_process,) + array.shape[1:], array.dtype)
        parts[name][selected] = array
      self._served_rows[k] += int(selected.sum())
    self._served_tokens += np.bincount(
        owners, weights=np.count_nonzero(parts["segment_ids"], axis=1),
        minlength=len(self._providers)).astype(np.int64)
    return features_from_rows(**parts)

  def recount_mixture_batches(self, steps: Iterable[int]) -> None:
    """Counts the tokens of global batches `steps` towards the next `mixture_record`
    without serving them: a resumed run's first record then covers the batches an
    uninterrupted run's would (those before the restored step included)."""
    if self._mixer is not None:
      for step in steps:
        self._mixture_batch(step)

  def mixture_record(self, step: int) -> Optional[Dict]:
    """For a mixture: a `metrics.jsonl` row (kind `mixture`) of the tokens and token
    share each task got in this process's rows since the last call, with the weights
    in force at `step`; then the counts restart. None for a single task."""
    if self._mixer is None or not self._served_rows.sum():
      return None
    total = max(int(self._served_tokens.sum()), 1)
    record = {"kind": mixing.RECORD_KIND, "step": int(step),
              "rows": int(self._served_rows.sum())}
    weights = self._mixer.weights_at(max(step - 1, 0))
    for k, name in enumerate(self._mixture.names):
      record[f"tokens/{name}"] = int(self._served_tokens[k])
      record[f"share/{name}"] = float(self._served_tokens[k] / total)
      record[f"weight/{name}"] = float(weights[k])
    self._served_tokens[:] = 0
    self._served_rows[:] = 0
    return record

  def validation_batches(self, max_batches: Optional[int] = None
                         ) -> Iterator[Batch]:
    """The validation split in order, as this process's slices of global batches.

    Every process yields the same number of batches; rows past the end of the split
    are padding (all weights 0), so the weighted mean loss is over real tokens only.
    """
    store = self.validation_store
    for b in range(self.validation_batch_count(max_batches)):
      start = b * self.batch_size + self.process_index * self.rows_per_process
      rows = np.arange(start, start + self.rows_per_process)
      real = rows[rows < store.num_rows]
      stored = store.read(real)
      padded = {name: np.zeros((self.rows_per_process, self.sequence_length),
                               array.dtype) for name, array in stored.items()}
      for name, array in stored.items():
        padded[name][:len(real)] = array
      yield features_from_rows(**padded)

  def validation_batch_count(self, max_batches: Optional[int] = None) -> int:
    """How many batches `validation_batches(max_batches)` yields."""
    count = -(-self.validation_store.num_rows // self.batch_size)
    return count if max_batches is None else min(count, max_batches)

  @property
  def validation_store(self) -> token_store.TokenStore:
    """The validation split's token store (built or opened by `__init__` when
    `open_validation`, else on first use)."""
    if self._validation_store is None:
      split = self._validation_split
      with_split = [p for p in self._providers if materialize.has_split(p, split)]
      if not with_split:
        source = getattr(self._provider, "source", None)
        setting = getattr(source, "fraction_setting", "the task's validation_fraction")
        raise DataError(
            f"SeqIO task '{self.task_name}' has no '{split}' split to evaluate on; set "
            f"{setting} > 0, DataPipeline.validation_split, or EVAL_EVERY = 0 with "
            "TrainConfig.final_eval = False", exit_code=EXIT_USAGE)
      stores = [self._store(provider, split, self._max_validation_documents)
                for provider in with_split]
      self._validation_store = (stores[0] if len(stores) == 1
                                else _ConcatenatedStores(stores))
    return self._validation_store

  def _store(self, provider, split: str, max_documents: Optional[int]
             ) -> token_store.TokenStore:
    name = materialize.store_name(provider, split, self.sequence_length, max_documents)
    if not self._build_missing:
      return self._prepared(name)
    return token_store.open_or_build(
        self._cache_dir, name, self.sequence_length,
        materialize.has_loss_mask(provider),
        lambda writer: materialize.fill_store(
            writer, provider, split, self.sequence_length, max_documents))

  def _prepared(self, name: str) -> token_store.TokenStore:
    """The complete store `name` (written by `prepare`), or the one-line error naming
    that command."""
    if storage.exists(storage.join(self._cache_dir, name, "metadata.json")):
      return token_store.TokenStore(storage.join(self._cache_dir, name))
    where = ("a multi-host run" if not storage.is_url(self._cache_dir)
             else "object storage")
    raise DataError(
        f"token store {storage.join(self._cache_dir, name)} is missing and {where} does "
        "not build one: prepare it first with `python -m pretrain.data.prepare "
        f"--gin_file=<this run's gin files> --output={self._cache_dir}`")

  def describe(self) -> str:
    """One line for the training log."""
    meta = self.train_store.metadata
    if self._mixture is not None:
      parts = ", ".join(
          f"{name} {store.metadata['num_tokens']} tokens in {store.num_rows} rows "
          f"({store.path})" for name, store in zip(self._mixture.names, self.train_stores))
      phases = "; ".join(
          f"from step {step}: " + ", ".join(
              f"{n} {w:.3g}" for n, w in zip(self._mixture.names, weights))
          for step, weights in self._mixture.phases)
      return (f"data: mixture {self.task_name} of {parts}; weights {phases}; "
              f"rows of {self.sequence_length}, vocab {self.vocab_size}")
    return (f"data: task {self.task_name}, {meta['num_documents']} documents, "
            f"{meta['num_tokens']} tokens in {self.num_train_rows} rows of "
            f"{self.sequence_length} ({self.steps_per_epoch:.1f} steps/epoch at "
            f"batch {self.batch_size}), vocab {self.vocab_size}; store "
            f"{self.train_store.path}")


class _ConcatenatedStores:
  """Several stores read as one (a mixture's validation splits, one after another)."""

  def __init__(self, stores):
    self._stores = stores
    self._starts = np.cumsum([0] + [s.num_rows for s in stores])
    self.num_rows = int(self._starts[-1])

  def read(self, rows: np.ndarray) -> Dict[str, np.ndarray]:
    rows = np.asarray(rows, np.int64)
    which = np.searchsorted(self._starts, rows, side="right") - 1
    out = {}
    for k in np.unique(which):
      selected = which == k
      for name, array in self._stores[k].read(rows[selected] - self._starts[k]).items():
        if name not in out:
          out[name] = np.zeros((len(rows),) + array.shape[1:], array.dtype)
        out[name][selected] = array
    if not out:
      out = self._stores[0].read(rows)
    return out
