"""Text files as a SeqIO data source, with a deterministic held-out validation split.

Documents come from `corpus_files` (one per file, or per `.jsonl` line). Validation
documents are chosen by a hash of each document's key (its path relative to the
glob's fixed prefix, plus the line number for JSONL), so the split is the same on
every machine and every run, and train and validation never share a document.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Optional, Sequence, Tuple

import seqio
import tensorflow as tf

from pretrain.data.corpus_files import (DEFAULT_EXCLUDE, DEFAULT_SHARD_BYTES,
                                        assign_validation, expand_pattern, glob_root,
                                        match_files, read_jsonl_texts)
from pretrain.data.errors import DataError

TRAIN = "train"
VALIDATION = "validation"


@dataclasses.dataclass(frozen=True)
class _FileStat:
  path: str
  key: str
  size: int
  mtime_ns: int


class TextFilesDataSource(seqio.DataSource):
  """Documents from files matching a glob, split into train and validation.

  Yields examples `{"text": tf.string}`. Plain files are read whole by TensorFlow (no
  per-document Python work); `.jsonl` files are parsed in Python so a bad line gets
  an error naming the file and line.
  """

  def __init__(self, pattern: str, validation_fraction: float = 0.02,
               exclude: Sequence[str] = DEFAULT_EXCLUDE,
               shard_bytes: int = DEFAULT_SHARD_BYTES):
    if shard_bytes < 1:
      raise DataError(f"shard_bytes={shard_bytes} must be >= 1, e.g. {DEFAULT_SHARD_BYTES}")
    self._pattern = pattern
    self._fraction = float(validation_fraction)
    self._exclude = tuple(exclude)
    self._shard_bytes = int(shard_bytes)
    files = match_files(pattern, self._exclude)
    root = glob_root(expand_pattern(pattern))
    self._files = tuple(
        _FileStat(path=p, key=os.path.relpath(p, root), size=st.st_size,
                  mtime_ns=st.st_mtime_ns)
        for p, st in ((p, os.stat(p)) for p in files))
    splits = (TRAIN, VALIDATION) if self._fraction > 0 else (TRAIN,)
    super().__init__(splits=splits)
    self._by_split = None

  @property
  def files(self) -> Tuple[str, ...]:
    return tuple(f.path for f in self._files)

  @property
  def num_shards(self) -> int:
    """Input shards of about `shard_bytes` of text each, at most one per file."""
    total = sum(f.size for f in self._files)
    return max(1, min(-(-total // self._shard_bytes), len(self._files)))

  @property
  def fingerprint(self) -> str:
    """Changes when the file list, a file's size or mtime, or the split changes."""
    h = hashlib.sha256()
    h.update(json.dumps([self._fraction, self._exclude, self._shard_bytes]).encode())
    for f in self._files:
      h.update(f"{f.key}\0{f.size}\0{f.mtime_ns}\n".encode())
    return h.hexdigest()

  @property
  def supports_arbitrary_sharding(self) -> bool:
    return False

  def list_shards(self, split: str) -> Sequence[str]:
    return list(self.files)

  def num_input_examples(self, split: str) -> Optional[int]:
    return None

  def _documents_by_split(self):
    """{split: (whole-file paths, JSONL texts)}, assigned over all documents at once."""
    if self._by_split is None:
      keys, documents = [], []
      for f in self._files:
        if f.path.endswith(".jsonl"):
          for i, text in enumerate(read_jsonl_texts(f.path)):
            keys.append(f"{f.key}:{i}")
            documents.append(("text", text))
        else:
          keys.append(f.key)
          documents.append(("path", f.path))
      flags = assign_validation(keys, self._fraction)
      self._by_split = {TRAIN: ([], []), VALIDATION: ([], [])}
      for (kind, value), is_validation in zip(documents, flags):
        paths, texts = self._by_split[VALIDATION if is_validation else TRAIN]
        (paths if kind == "path" else texts).append(value)
    return self._by_split

  def get_dataset(self, split: str = TRAIN, shuffle: bool = True,
                  seed: Optional[int] = None,
                  shard_info: Optional[seqio.ShardInfo] = None) -> tf.data.Dataset:
    if split not in self.splits:
      raise DataError(
          f"text files task has no split '{split}' (splits: {self.splits}); "
          "set text_files_task.validation_fraction > 0 for a validation split")
    paths, texts = self._documents_by_split()[split]
    if shard_info is not None:
      paths = paths[shard_info.index::shard_info.num_shards]
      texts = texts[shard_info.index::shard_info.num_shards]
    file_ds = tf.data.Dataset.from_tensor_slices(tf.constant(paths, tf.string))
    if shuffle:
      file_ds = file_ds.shuffle(max(len(paths), 1), seed=seed)
    file_ds = file_ds.map(
        lambda p: {"text": tf.io.read_file(p)},
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    text_ds = tf.data.Dataset.from_tensor_slices(
        {"text": tf.constant(texts, tf.string)})
    if shuffle:
      text_ds = text_ds.shuffle(max(len(texts), 1), seed=seed)
    return file_ds.concatenate(text_ds)
