"""A Hugging Face `datasets` directory written by `Dataset.save_to_disk`: its Arrow
files (Arrow IPC streams, listed in `state.json`), read with pyarrow, one record batch
at a time and only the text column. A `DatasetDict` directory (`dataset_dict.json`) is
read through its split subdirectory (`hf_split`, `train` by default)."""
from __future__ import annotations

import json
from typing import Iterator, List, Optional

import pyarrow as pa

from plumbing import storage
from pretrain.data.errors import DataError
from pretrain.data.sources.sharded import (Piece, Shard, ShardedTextSource, list_shards,
                                           missing_field, open_binary)


class HfDatasetDataSource(ShardedTextSource):
  """Documents from the `text_field` column of a `save_to_disk` directory."""
  FORMAT = "Arrow (datasets save_to_disk)"
  SUFFIXES = (".arrow",)

  def __init__(self, location: str, *args, hf_split: str = "train", **kwargs):
    self.hf_split = hf_split
    super().__init__(location, *args, **kwargs)

  def _list(self, location: str, flag: str) -> List[Shard]:
    root = location.rstrip("/")
    if storage.exists(storage.join(root, "dataset_dict.json")):
      splits = json.loads(storage.read_text(storage.join(root, "dataset_dict.json")))
      if self.hf_split not in splits.get("splits", []):
        raise DataError(
            f"{root} is a DatasetDict without a '{self.hf_split}' split (it has: "
            f"{', '.join(splits.get('splits', []))}); set corpus_task.hf_split")
      root = storage.join(root, self.hf_split)
    state_path = storage.join(root, "state.json")
    if not storage.exists(state_path):
      raise DataError(
          f"{flag}='{location}' is not a `datasets` save_to_disk directory (no "
          "state.json); point it at the directory `Dataset.save_to_disk` wrote")
    state = json.loads(storage.read_text(state_path))
    names = [entry["filename"] for entry in state.get("_data_files", [])]
    shards = {s.key: s for s in list_shards(root, self.SUFFIXES, flag)}
    missing = [name for name in names if name not in shards]
    if missing:
      raise DataError(f"{storage.join(root, missing[0])} is listed in {state_path} but "
                      "missing; copy the whole directory again")
    return [shards[name] for name in names]

  def _pieces(self, shard: Shard) -> List[Piece]:
    with open_binary(shard.path) as f:
      names = pa.ipc.open_stream(f).schema.names
    if self.text_field not in names:
      raise missing_field(shard.path, self.text_field, names, self.setting("text_field"))
    return [Piece(shard)]   # an Arrow stream has no footer to find its batches by

  def _texts(self, piece: Piece) -> Iterator[Optional[str]]:
    with open_binary(piece.shard.path) as f:
      reader = pa.ipc.open_stream(f)
      column = reader.schema.get_field_index(self.text_field)
      for batch in reader:
        yield from batch.column(column).to_pylist()
