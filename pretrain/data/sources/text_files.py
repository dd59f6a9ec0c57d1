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
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import seqio
import tensorflow as tf

from pretrain.data.corpus_files import (DEFAULT_EXCLUDE, DEFAULT_SHARD_BYTES,
                                        assign_validation, expand_pattern, glob_root,
                                        iter_jsonl_texts, match_files)
from pretrain.data.errors import DataError
from pretrain.data.sources.sharded import FileListSource

TRAIN = "train"
VALIDATION = "validation"


@dataclasses.dataclass(frozen=True)
class _FileStat:
  path: str
  key: str
  size: int
  mtime_ns: int


class TextFilesDataSource(FileListSource):
  """Documents from files matching a glob, split into train and validation.

  Yields examples `{"text": tf.string}`. Plain files are read whole by TensorFlow (no
  per-document Python work); `.jsonl` files are streamed and parsed in Python, line by
  line, so a bad line gets an error naming the file and line and a corpus of any size
  is never held in memory: what is kept per JSONL document is one split flag (a byte).
  """
  SHUFFLE_BUFFER = 10_000  # JSONL documents shuffled together when `shuffle` is set
  files_setting = "TRAIN_FILES (text_files_task.train_files)"
  fraction_setting = "text_files_task.validation_fraction"

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

  def _documents_by_split(self):
    """{split: (whole-file paths, [(JSONL path, which of its documents)])}, assigned
    over all documents at once (keys are held only while assigning)."""
    if self._by_split is None:
      keys, documents = [], []
      for f in self._files:
        if f.path.endswith(".jsonl"):
          count = sum(1 for _ in iter_jsonl_texts(f.path))  # validates every line
          keys += [f"{f.key}:{i}" for i in range(count)]
          documents.append(("jsonl", f.path, count))
        else:
          keys.append(f.key)
          documents.append(("path", f.path, 1))
      flags = np.asarray(assign_validation(keys, self._fraction), bool)
      del keys
      self._by_split = {TRAIN: ([], []), VALIDATION: ([], [])}
      start = 0
      for kind, path, count in documents:
        in_validation = flags[start:start + count]
        start += count
        if kind == "path":
          self._by_split[VALIDATION if in_validation[0] else TRAIN][0].append(path)
          continue
        for split, selected in ((TRAIN, ~in_validation), (VALIDATION, in_validation)):
          if selected.any():
            self._by_split[split][1].append((path, selected))
    return self._by_split

  @staticmethod
  def _jsonl_texts(selections: List[Tuple[str, np.ndarray]],
                   shard_info: Optional[seqio.ShardInfo]) -> Iterator[str]:
    """The split's JSONL documents in file and line order, streamed; with `shard_info`
    every num_shards-th of them, starting at the shard's index."""
    position = 0
    for path, selected in selections:
      for text, wanted in zip(iter_jsonl_texts(path), selected):
        if not wanted:
          continue
        if shard_info is None or position % shard_info.num_shards == shard_info.index:
          yield text
        position += 1

  def get_dataset(self, split: str = TRAIN, shuffle: bool = True,
                  seed: Optional[int] = None,
                  shard_info: Optional[seqio.ShardInfo] = None) -> tf.data.Dataset:
    if split not in self.splits:
      raise DataError(
          f"text files task has no split '{split}' (splits: {self.splits}); "
          f"set {self.fraction_setting} > 0 for a validation split")
    paths, selections = self._documents_by_split()[split]
    if shard_info is not None:
      paths = paths[shard_info.index::shard_info.num_shards]
    file_ds = tf.data.Dataset.from_tensor_slices(tf.constant(paths, tf.string))
    if shuffle:
      file_ds = file_ds.shuffle(max(len(paths), 1), seed=seed)
    file_ds = file_ds.map(
        lambda p: {"text": tf.io.read_file(p)},
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    text_ds = tf.data.Dataset.from_generator(
        lambda: ({"text": text} for text in self._jsonl_texts(selections, shard_info)),
        output_signature={"text": tf.TensorSpec((), tf.string)})
    if shuffle:
      text_ds = text_ds.shuffle(self.SHUFFLE_BUFFER, seed=seed)
    return file_ds.concatenate(text_ds)
