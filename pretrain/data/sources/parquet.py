"""Parquet shards (FineWeb, DCLM's parquet release, most Hub datasets): only the text
column is read, one row group at a time, so memory is bounded by the largest row group's
text, never by the file.

A file is cut into pieces of whole row groups, about `shard_bytes` of (uncompressed)
text each (256 MiB by default, `corpus_files.PARQUET_SHARD_BYTES`), from the sizes in
its footer: each piece is an input shard of its own, so `pretrain.data.prepare` reads a
single large file with many workers in parallel."""
from __future__ import annotations

from typing import Iterator, List, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from pretrain.data.corpus_files import PARQUET_SHARD_BYTES
from pretrain.data.errors import DataError
from pretrain.data.sources.sharded import (Piece, Shard, ShardedTextSource, missing_field,
                                           open_binary)


class ParquetDataSource(ShardedTextSource):
  """Documents from the `text_field` column of Parquet files (a glob, a directory of
  `.parquet` shards or one file). Every footer is read when the source is made, so a
  corrupt shard or a missing column stops the run before any training."""
  FORMAT = "Parquet"
  SUFFIXES = (".parquet",)

  def __init__(self, location: str, *args, shard_bytes: int = PARQUET_SHARD_BYTES,
               **kwargs):
    if shard_bytes < 1:
      raise DataError(f"shard_bytes={shard_bytes} must be >= 1, e.g. {PARQUET_SHARD_BYTES}")
    self.shard_bytes = int(shard_bytes)
    super().__init__(location, *args, **kwargs)

  def _open(self, shard: Shard) -> pq.ParquetFile:
    return pq.ParquetFile(open_binary(shard.path))

  def _pieces(self, shard: Shard) -> List[Piece]:
    with self._open(shard) as parquet:
      names = parquet.schema_arrow.names
      if self.text_field not in names:
        raise missing_field(shard.path, self.text_field, names,
                            self.setting("text_field"))
      kind = parquet.schema_arrow.field(self.text_field).type
      if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
              or pa.types.is_string_view(kind)):
        raise DataError(
            f"{shard.path}: column '{self.text_field}' holds {kind}, not text; set "
            f"{self.setting('text_field')} to the column that holds the text")
      metadata = parquet.metadata
    column = next(j for j in range(metadata.num_columns)
                  if metadata.schema.column(j).path == self.text_field)
    pieces: List[Piece] = []
    first_group, first_row, row, size = 0, 0, 0, 0
    for group in range(metadata.num_row_groups):
      row_group = metadata.row_group(group)
      row += row_group.num_rows
      size += row_group.column(column).total_uncompressed_size
      if size >= self.shard_bytes or group == metadata.num_row_groups - 1:
        pieces.append(Piece(shard, first_group, group + 1, first_row))
        first_group, first_row, size = group + 1, row, 0
    return pieces

  def _texts(self, piece: Piece) -> Iterator[Optional[str]]:
    with self._open(piece.shard) as parquet:
      end = parquet.num_row_groups if piece.end_group is None else piece.end_group
      for group in range(piece.first_group, end):
        column = parquet.read_row_group(group, columns=[self.text_field]).column(0)
        yield from column.to_pylist()
