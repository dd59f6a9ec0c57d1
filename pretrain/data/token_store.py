"""On-disk token stores: packed rows in tensorstore zarr3 arrays, built once and cached.

A store is a directory holding `targets` and `segment_ids` (int32 `[rows, T]`), an
optional `loss_mask` (uint8), and `metadata.json`. Arrays are zarr3 with the sharding
codec: one file per shard of rows, holding zstd-compressed chunks of a few rows (about
8 KiB), so reading a random row reads and decompresses little more than that row.

Stores live in a cache directory under a name derived from a hash of everything that
determines their content (the caller's `key_parts`). `metadata.json` is the store's
manifest and is always written last: a directory without it is never opened. A build
in this process writes into a temporary sibling directory and renames it into place only
when complete, so a killed build never leaves a store that a later run would pick up; a
file lock lets concurrent processes (e.g. several hosts of `launch.local` sharing a
disk) build it once. `python -m pretrain.data.prepare` writes the same layout in place,
from many workers, into a local directory or a bucket (see `pretrain/data/preparation.py`).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import uuid
from typing import Callable, Dict

import numpy as np
import tensorstore as ts

from plumbing import storage
from pretrain.data import kvstore
from pretrain.data.errors import DataError
from pretrain.data.packing import PackedRows

# 2: rows are packed per input shard (materialize.num_shards), padded at shard ends.
FORMAT_VERSION = 2
METADATA = "metadata.json"
_SHARD_BYTES = 4 << 20  # uncompressed bytes of one shard file
_CHUNK_BYTES = 8 << 10  # uncompressed bytes of one chunk inside a shard
_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 64 << 20}})


def store_name(label: str, key_parts: Dict) -> str:
  """`<label>-<hash>`: readable, and unique to the content-defining `key_parts`."""
  blob = json.dumps({"format": FORMAT_VERSION, **key_parts}, sort_keys=True,
                    default=str)
  digest = hashlib.sha256(blob.encode()).hexdigest()[:20]
  return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)}-{digest}"


def _open_spec(path: str) -> Dict:
  return {"driver": "zarr3", "kvstore": storage.kvstore_spec(path), "open": True}


def rows_per_shard(sequence_length: int) -> int:
  """Rows in one shard file of the arrays: the unit that exactly one writer writes."""
  chunk_rows = max(1, _CHUNK_BYTES // (4 * sequence_length))
  return max(1, _SHARD_BYTES // (4 * sequence_length * chunk_rows)) * chunk_rows


def array_dtypes(with_loss_mask: bool) -> Dict[str, str]:
  names = {"targets": "int32", "segment_ids": "int32"}
  if with_loss_mask:
    names["loss_mask"] = "uint8"
  return names


def _create_spec(path: str, dtype: str, sequence_length: int, num_rows: int) -> Dict:
  """A new array `[num_rows, T]`, or the existing one of the same metadata (a resumed
  writer's)."""
  return {
      "driver": "zarr3", "kvstore": storage.kvstore_spec(path),
      "create": True, "open": True,
      "metadata": {
        "shape": [num_rows, sequence_length],
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {
            "chunk_shape": [rows_per_shard(sequence_length), sequence_length]}},
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": [max(1, _CHUNK_BYTES // (4 * sequence_length)),
                            sequence_length],
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                       {"name": "zstd", "configuration": {"level": 1}}]}}],
      },
  }


class TokenStore:
  """Read access to a complete store."""

  def __init__(self, path: str):
    self.path = path
    metadata = kvstore.read_json(path, METADATA)
    if metadata is None:
      raise incomplete_store_error(path)
    self.metadata = metadata
    self.num_rows = int(self.metadata["num_rows"])
    self.sequence_length = int(self.metadata["sequence_length"])
    self._arrays = open_arrays(path, self.metadata["arrays"])

  def read(self, rows: np.ndarray) -> Dict[str, np.ndarray]:
    """The stored arrays at `rows` (any order, repeats allowed), each `[len(rows), T]`."""
    rows = np.asarray(rows, np.int64)
    if rows.size == 0:
      return {name: np.zeros((0, self.sequence_length), a.dtype.numpy_dtype)
              for name, a in self._arrays.items()}
    unique, inverse = np.unique(rows, return_inverse=True)
    futures = {name: a.oindex[unique].read() for name, a in self._arrays.items()}
    return {name: f.result()[inverse] for name, f in futures.items()}


class StoreWriter:
  """Appends packed rows to new arrays, writing whole shards where it can."""

  def __init__(self, path: str, sequence_length: int, with_loss_mask: bool):
    self._sequence_length = sequence_length
    self._rows_per_shard = rows_per_shard(sequence_length)
    names = array_dtypes(with_loss_mask)
    # An array left by a killed writer is opened and emptied (its stale chunks are
    # outside the shape, and are overwritten as rows are appended again).
    self._arrays = {
        name: array.resize(exclusive_max=[0, sequence_length],
                           resize_metadata_only=True).result()
        for name, array in create_arrays(path, sequence_length, with_loss_mask,
                                         0).items()}
    self._pending = {name: [] for name in names}
    self._pending_rows = 0
    self.num_rows = 0
    self.num_tokens = 0

  @property
  def array_names(self):
    return sorted(self._arrays)

  def append(self, packed: PackedRows) -> None:
    for name in self._pending:
      self._pending[name].append(getattr(packed, name))
    self._pending_rows += packed.num_rows
    self.num_tokens += int(np.count_nonzero(packed.segment_ids))
    if self._pending_rows >= self._rows_per_shard:
      self._flush(self._pending_rows // self._rows_per_shard * self._rows_per_shard)

  def close(self) -> None:
    self._flush(self._pending_rows)

  def _flush(self, count: int) -> None:
    if count == 0:
      return
    end = self.num_rows + count
    writes = []
    for name, array in self._arrays.items():
      data = np.concatenate(self._pending[name])
      array = array.resize(exclusive_max=[end, self._sequence_length],
                           resize_metadata_only=True).result()
      self._arrays[name] = array
      writes.append(array[self.num_rows:end].write(data[:count]))
      self._pending[name] = [data[count:]]
    for w in writes:
      w.result()
    self.num_rows = end
    self._pending_rows -= count


def create_arrays(path: str, sequence_length: int, with_loss_mask: bool,
                  num_rows: int) -> Dict[str, ts.TensorStore]:
  """The store's arrays `[num_rows, T]` under `path` (opened if they already exist)."""
  return {name: ts.open(_create_spec(storage.join(path, name), dtype, sequence_length,
                                     num_rows)).result()
          for name, dtype in array_dtypes(with_loss_mask).items()}


def open_arrays(path: str, names) -> Dict[str, ts.TensorStore]:
  return {name: ts.open(_open_spec(storage.join(path, name)), context=_CONTEXT).result()
          for name in names}


def incomplete_store_error(path: str) -> DataError:
  return DataError(
      f"token store {path} exists but has no {METADATA}: a `python -m "
      "pretrain.data.prepare` run was interrupted; rerun it to finish the store (it "
      "skips finished shards) or delete the directory")


@contextlib.contextmanager
def _locked(lock_path: str):
  with open(lock_path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def open_or_build(cache_dir: str, name: str, sequence_length: int,
                  with_loss_mask: bool,
                  build_fn: Callable[[StoreWriter], Dict]) -> TokenStore:
  """Opens the store `cache_dir/name`, building it with `build_fn` if absent.

  Args:
    cache_dir: directory of stores (created if needed).
    name: the store's name, from `store_name`.
    sequence_length: row length T.
    with_loss_mask: whether rows carry a `loss_mask`.
    build_fn: called only when building; appends the packed rows, in order, to the
      writer it is given and returns JSON-able facts to record in the metadata.
  """
  cache_dir = os.path.expanduser(cache_dir)
  os.makedirs(cache_dir, exist_ok=True)
  final = os.path.join(cache_dir, name)
  if os.path.exists(os.path.join(final, METADATA)):
    return TokenStore(final)
  with _locked(final + ".lock"):
    if os.path.exists(os.path.join(final, METADATA)):
      return TokenStore(final)  # another process built it while we waited
    if os.path.exists(final):  # written in place by `prepare`, which did not finish
      raise incomplete_store_error(final)
    for stale in os.listdir(cache_dir):  # left by killed builds; we hold the lock
      if stale.startswith(f".{name}.tmp-"):
        shutil.rmtree(os.path.join(cache_dir, stale), ignore_errors=True)
    temporary = os.path.join(cache_dir, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
      writer = StoreWriter(temporary, sequence_length, with_loss_mask)
      info = dict(build_fn(writer))
      writer.close()
      info.update(format=FORMAT_VERSION, num_rows=writer.num_rows,
                  num_tokens=writer.num_tokens, sequence_length=sequence_length,
                  arrays=writer.array_names)
      with open(os.path.join(temporary, METADATA), "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
      os.rename(temporary, final)
    finally:
      shutil.rmtree(temporary, ignore_errors=True)
  return TokenStore(final)
