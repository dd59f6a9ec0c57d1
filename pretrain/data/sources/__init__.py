"""SeqIO data sources of the corpora the trainer reads, one module per format.

- `text_files`: plain text files (one document per file) and plain `.jsonl` under a glob,
  with a held-out split chosen over all documents (`TextFilesDataSource`).
- `parquet`: Parquet shards, only the text column, row group by row group.
- `jsonl`: `.jsonl`, `.jsonl.gz` and `.jsonl.zst` shards, streamed line by line.
- `hf_dataset`: a Hugging Face `datasets` directory written by `save_to_disk` (its Arrow
  files, read with pyarrow).

The last three share `sharded.ShardedTextSource`: a glob, a directory or one file is one
source (local, `gs://` or `s3://`, through `plumbing.storage`), one input shard per file
(per run of row groups for Parquet), the text field named per source, and a validation split by a hash of each document's
(file, row) key, so no pass over the corpus is needed before training. Bad input is a
`DataError` naming the file and the fix.
"""
from pretrain.data.sources.hf_dataset import HfDatasetDataSource
from pretrain.data.sources.jsonl import JsonlDataSource
from pretrain.data.sources.parquet import ParquetDataSource
from pretrain.data.errors import DataError
from pretrain.data.sources.sharded import (FORMATS, FileListSource, ShardedTextSource,
                                           detect_format)
from pretrain.data.sources.text_files import TRAIN, VALIDATION, TextFilesDataSource

__all__ = ["FORMATS", "FileListSource", "HfDatasetDataSource", "JsonlDataSource", "ParquetDataSource",
           "ShardedTextSource", "TRAIN", "TextFilesDataSource", "VALIDATION",
           "detect_format", "source_for"]


def source_for(fmt: str) -> type:
  """The source class of a format name (`corpus_task.format`)."""
  classes = {"parquet": ParquetDataSource, "jsonl": JsonlDataSource,
             "hf_dataset": HfDatasetDataSource}
  if fmt not in classes:
    raise DataError(f"corpus_task.format='{fmt}' is not one of {', '.join(classes)}")
  return classes[fmt]
