"""Parquet shards (FineWeb, DCLM's parquet release, most Hub datasets): only the text
column is read, one row group at a time, so memory is bounded by the largest row group's
text, never by the file."""
from __future__ import annotations

from typing import Iterator, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from pretrain.data.errors import DataError
from pretrain.data.sources.sharded import (Shard, ShardedTextSource, missing_field,
                                           open_binary)


class ParquetDataSource(ShardedTextSource):
  """Documents from the `text_field` column of Parquet files (a glob, a directory of
  `.parquet` shards or one file). Every footer is read when the source is made, so a
  corrupt shard or a missing column stops the run before any training."""
  FORMAT = "Parquet"
  SUFFIXES = (".parquet",)

  def _open(self, shard: Shard) -> pq.ParquetFile:
    return pq.ParquetFile(open_binary(shard.path))

  def _check(self, shard: Shard) -> None:
    with self._open(shard) as parquet:
      names = parquet.schema_arrow.names
      if self.text_field not in names:
        raise missing_field(shard.path, self.text_field, names, self._flag.split(".")[0])
      kind = parquet.schema_arrow.field(self.text_field).type
      if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
              or pa.types.is_string_view(kind)):
        raise DataError(
            f"{shard.path}: column '{self.text_field}' holds {kind}, not text; set "
            f"{self._flag.split('.')[0]}.text_field to the column that holds the text")

  def _texts(self, shard: Shard) -> Iterator[Optional[str]]:
    with self._open(shard) as parquet:
      for group in range(parquet.num_row_groups):
        column = parquet.read_row_group(group, columns=[self.text_field]).column(0)
        yield from column.to_pylist()
