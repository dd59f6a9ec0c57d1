"""Turning any registered SeqIO task or mixture into packed rows in a token store.

The SeqIO task stays the definition of the data (source, preprocessors, vocabulary);
this module runs its `tf.data` pipeline once, unshuffled, batching documents as ragged
tensors so the per-document Python work is nil, and packs them in large groups with
`packing.pack_documents` (padding only at group ends, under one row per group).

Loss weights: a task whose output features include `inputs` is a prefix LM: each
document is `inputs ++ targets` and only the `targets` part carries loss weight. A
task may also give a 0/1 `loss_mask` feature aligned with `targets` (e.g. synthetic
probes that score only some positions); tokens where it is 0 carry no loss weight.

Input shards: a split is read as `num_shards` SeqIO shards (`seqio.ShardInfo`: by
source file where the source has enough files, else every n-th example), each packed on
its own and padded at its end, and the store holds shard 0's rows, then shard 1's, ...
The shard count is a function of the task alone (about 4 MiB of text per shard for
text files, `text_files_task.shard_bytes`; for Parquet, cut at row groups, 256 MiB,
`corpus_task.shard_bytes`; one shard per file for JSONL, Arrow and TFDS), never of how
many workers run, so the in-process build here and `python -m pretrain.data.prepare` (one Beam worker per shard)
write identical stores. A document cap `max_documents` is split evenly over the shards.

A mixture samples its tasks at their rates (seed 0). Without a document cap it runs
one pass, which SeqIO ends when the first task runs out; with `max_documents` its
tasks repeat, so small tasks mixed at high rates are revisited as SeqIO intends.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import re
from typing import Any, Dict, Iterator, Optional, Tuple

from etils import epy
import numpy as np

from pretrain.data import packing, synthetic, tasks, token_store
from plumbing.errors import EXIT_USAGE
from pretrain.data.errors import DataError
from pretrain.data.vocabularies import vocabulary_fingerprint

# SeqIO and TensorFlow load on first use (about 6 s): commands that only parse
# configs, print help or plan memory never touch them.
with epy.lazy_imports():
  import seqio
  import tensorflow as tf
  from pretrain.data import sources  # defines a seqio.DataSource subclass

_GROUP_TOKENS = 1 << 22   # tokens packed together (one padded row at most per group)
_BATCH_DOCUMENTS = 256    # documents per ragged batch out of tf.data
_MAX_SHARDS = 4096


def get_provider(name: str) -> seqio.DatasetProviderBase:
  """The registered task or mixture `name`, or an error listing what exists."""
  tasks.register_default_tasks()
  synthetic.add_to_seqio()
  try:
    provider = seqio.get_mixture_or_task(name)
  except ValueError:
    known = sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))
    raise DataError(
        f"no SeqIO task or mixture named '{name}' is registered (import the module "
        f"that registers it); registered: {', '.join(known)}") from None
  if "targets" not in provider.output_features:
    raise DataError(
        f"SeqIO task '{name}' has no 'targets' output feature; language-model "
        "tasks need 'targets' (and optionally 'inputs' for prefix-LM tasks)")
  return provider


def has_split(provider: seqio.DatasetProviderBase, split: str) -> bool:
  if isinstance(provider, seqio.Mixture):
    return any(split in task.splits for task in provider.tasks)
  return split in provider.splits


def _function_fingerprint(fn: Any) -> str:
  """Identifies a preprocessor / dataset function by its source file and arguments."""
  if isinstance(fn, functools.partial):
    return (f"partial({_function_fingerprint(fn.func)}, {fn.args!r}, "
            f"{sorted(fn.keywords.items())!r})")
  name = getattr(fn, "__module__", "") + "." + getattr(
      fn, "__qualname__", type(fn).__qualname__)
  try:  # the whole defining file, so edits to helpers it calls count too
    with open(inspect.getsourcefile(fn), "rb") as f:
      code = hashlib.sha256(f.read()).hexdigest()[:16]
  except (OSError, TypeError):
    code = "?"
  return f"{name}#{code}"


def _source_fingerprint(source: seqio.DataSource) -> Any:
  if isinstance(source, sources.TextFilesDataSource):
    return ["text_files", source.fingerprint]
  if isinstance(source, sources.ShardedTextSource):
    return [type(source).__name__, source.fingerprint]
  if isinstance(source, seqio.TfdsDataSource):
    return ["tfds", source.tfds_dataset.name, source.tfds_dataset.data_dir,
            sorted(source.splits)]
  if isinstance(source, seqio.FunctionDataSource):
    return ["function", _function_fingerprint(source._dataset_fn),  # pylint: disable=protected-access
            sorted(source.splits)]
  return [type(source).__qualname__, repr(source)]


def provider_fingerprint(provider: seqio.DatasetProviderBase) -> Any:
  """What determines a task's (or mixture's) documents, as JSON-able data.

  Covers the source (for text files: every file's path, size and mtime), the
  preprocessors' code and arguments, and the vocabularies. A task computed from
  settings read elsewhere at run time (not passed as arguments) is not covered:
  put such settings in the task name or in `functools.partial` arguments.
  """
  if isinstance(provider, seqio.Mixture):
    return {"mixture": provider.name, "tasks": [
        [provider_fingerprint(task), repr(provider.get_rate(task))]
        for task in provider.tasks]}
  return {
      "task": provider.name,
      "source": _source_fingerprint(provider.source),
      "preprocessors": [_function_fingerprint(p) for p in provider.preprocessors],
      "features": {k: [vocabulary_fingerprint(f.vocabulary), f.add_eos]
                   for k, f in sorted(provider.output_features.items())},
  }


def store_name(provider: seqio.DatasetProviderBase, split: str, sequence_length: int,
               max_documents: Optional[int]) -> str:
  """The name of the split's token store: the trainer's cache and `prepare` agree on it,
  so a prepared directory serves as the trainer's cache directory."""
  key_parts = {
      "provider": provider_fingerprint(provider),
      "split": split,
      "vocabulary": vocabulary_fingerprint(provider.output_features["targets"].vocabulary),
      "sequence_length": sequence_length,
      "max_documents": max_documents,
      "num_shards": num_shards(provider, split),
  }
  return token_store.store_name(f"{provider.name}-{split}-T{sequence_length}", key_parts)


def has_loss_mask(provider: seqio.DatasetProviderBase) -> bool:
  """Whether some of the task's tokens carry no loss weight (stored as `loss_mask`)."""
  return bool({"inputs", "loss_mask"} & set(provider.output_features))


def _tfds_error(task: seqio.Task, error: Exception) -> DataError:
  return DataError(
      f"could not load TFDS dataset '{task.source.tfds_dataset.name}' for task "
      f"'{task.name}' ({type(error).__name__}: {str(error).splitlines()[0]}); prepare "
      "it first (e.g. `tfds build`) or set the task's tfds_data_dir")


def num_shards(provider: seqio.DatasetProviderBase, split: str) -> int:
  """How many input shards the split is packed in (see the module docstring)."""
  if isinstance(provider, seqio.Mixture):
    return min(num_shards(task, split) for task in provider.tasks
               if has_split(task, split))
  source = provider.source
  if isinstance(source, (sources.TextFilesDataSource, sources.ShardedTextSource)):
    return source.num_shards
  if isinstance(source, seqio.TfdsDataSource):
    try:  # the dataset's file list (metadata only; every host that trains needs it)
      return max(1, min(len(source.list_shards(split)), _MAX_SHARDS))
    except Exception as e:  # pylint: disable=broad-except
      raise _tfds_error(provider, e) from None
  return 1


def shard_quota(max_documents: Optional[int], shard: seqio.ShardInfo
                ) -> Optional[int]:
  """Shard `shard.index`'s part of a document cap split evenly over the shards."""
  if max_documents is None:
    return None
  share, extra = divmod(max_documents, shard.num_shards)
  return share + (shard.index < extra)


def _documents(provider: seqio.DatasetProviderBase, split: str,
               sequence_length: int, max_documents: Optional[int],
               shard: seqio.ShardInfo) -> tf.data.Dataset:
  """The shard as `{"tokens": int32[n]}`, plus `loss_mask` if `has_loss_mask`."""
  lengths = {k: sequence_length for k in provider.output_features}
  repeat = isinstance(provider, seqio.Mixture) and max_documents is not None
  try:
    ds = provider.get_dataset(sequence_length=lengths, split=split, shuffle=False,
                              seed=0, num_epochs=None if repeat else 1,
                              trim_output_features=False,
                              shard_info=shard if shard.num_shards > 1 else None)
  except DataError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    if isinstance(provider, seqio.Task) and isinstance(
        provider.source, seqio.TfdsDataSource):
      raise _tfds_error(provider, e) from None
    raise
  features = provider.output_features

  def to_document(example):
    tokens = tf.cast(tf.reshape(example["targets"], [-1]), tf.int32)
    mask = tf.ones_like(tokens, tf.uint8)
    if "loss_mask" in features:
      mask = tf.cast(tf.reshape(example["loss_mask"], [-1]) > 0, tf.uint8)
      # An EOS appended to `targets` only is scored.
      mask = tf.pad(mask, [[0, tf.size(tokens) - tf.size(mask)]], constant_values=1)
    if "inputs" in features:
      inputs = tf.cast(tf.reshape(example["inputs"], [-1]), tf.int32)
      tokens = tf.concat([inputs, tokens], 0)
      mask = tf.concat([tf.zeros_like(inputs, tf.uint8), mask], 0)
    if not has_loss_mask(provider):
      return {"tokens": tokens}
    return {"tokens": tokens, "loss_mask": mask}

  return ds.map(to_document, num_parallel_calls=tf.data.AUTOTUNE,
                deterministic=True)


def _as_ragged(values: tf.Tensor) -> tf.RaggedTensor:
  return values if isinstance(values, tf.RaggedTensor) else tf.RaggedTensor.from_tensor(values)


def packed_groups(provider: seqio.DatasetProviderBase, split: str,
                  sequence_length: int, max_documents: Optional[int] = None,
                  shard: Optional[seqio.ShardInfo] = None
                  ) -> Iterator[Tuple[packing.PackedRows, int]]:
  """Packed rows of one input shard of a split (default: the whole split), in order,
  with the number of documents in each group. Memory stays bounded: documents stream
  through in groups."""
  shard = shard or seqio.ShardInfo(0, 1)
  quota = shard_quota(max_documents, shard)
  ds = _documents(provider, split, sequence_length, quota, shard)
  if quota is not None:
    ds = ds.take(quota)
  ds = ds.ragged_batch(_BATCH_DOCUMENTS).prefetch(2)
  pending = []

  def pack(parts):
    tokens = np.concatenate([p[0] for p in parts])
    lengths = np.concatenate([p[1] for p in parts])
    mask = (np.concatenate([p[2] for p in parts]) if parts[0][2] is not None
            else None)
    return packing.pack_documents(tokens, lengths, sequence_length, mask), int(
        np.count_nonzero(lengths))

  pending_tokens = 0
  for batch in _reraising_data_errors(ds):
    # ragged_batch yields a dense tensor when every document has the same length.
    tokens = _as_ragged(batch["tokens"])
    mask = batch.get("loss_mask")
    mask = None if mask is None else _as_ragged(mask)
    pending.append((tokens.flat_values.numpy(), tokens.row_lengths().numpy(),
                    None if mask is None else mask.flat_values.numpy()))
    pending_tokens += pending[-1][0].size
    if pending_tokens >= _GROUP_TOKENS:
      yield pack(pending)
      pending, pending_tokens = [], 0
  if pending:
    yield pack(pending)


def _reraising_data_errors(ds: tf.data.Dataset) -> Iterator[Any]:
  """Iterates `ds`; a DataError a source raised inside tf.data (which wraps it in an
  OpError with the traceback) comes out as that DataError, one line."""
  iterator = iter(ds)
  while True:
    try:
      yield next(iterator)
    except StopIteration:
      return
    except tf.errors.OpError as error:
      found = re.findall(r"DataError: (.+)", str(error))
      if not found:
        raise
      raise DataError(found[-1].strip()) from None


def fill_store(writer, provider: seqio.DatasetProviderBase, split: str,
               sequence_length: int, max_documents: Optional[int]) -> Dict:
  """Appends a split's packed rows to `writer`, shard by shard; returns facts for the
  metadata."""
  documents = 0
  shards = num_shards(provider, split)
  for index in range(shards):
    for packed, count in packed_groups(provider, split, sequence_length,
                                       max_documents, seqio.ShardInfo(index, shards)):
      writer.append(packed)
      documents += count
  if documents == 0:
    raise empty_split_error(provider, split)
  return {"task": provider.name, "split": split, "num_documents": documents,
          "num_shards": shards}


def empty_split_error(provider: seqio.DatasetProviderBase, split: str) -> DataError:
  """The split holds no document with text: for a held-out split the usual cause is a
  fraction too small for the corpus (not empty documents), so the fix named is the
  task's own fraction setting, a configuration error (exit 2); for the train split, the
  task's files, a data problem (exit 1, as the README's exit codes say)."""
  source = getattr(provider, "source", None)
  prefix = f"the '{split}' split of SeqIO task '{provider.name}' has no tokens"
  if not isinstance(source, sources.FileListSource):
    return DataError(f"{prefix}: none of its documents has text")
  if split == "validation":
    return DataError(
        f"{prefix}: {source.fraction_setting}={source.validation_fraction:g} held out no "
        f"document with text from {source.files_setting}; raise "
        f"{source.fraction_setting}, add documents, or set it to 0 (no validation "
        "split, no evaluation)", exit_code=EXIT_USAGE)
  return DataError(f"{prefix}: no document of {source.files_setting} has text; check "
                   "that it matches files with text")
