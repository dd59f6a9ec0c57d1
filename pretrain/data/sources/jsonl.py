"""JSON lines, plain or compressed (`.jsonl.gz`; `.jsonl.zst` as Dolma, DCLM and
RedPajama ship): decompressed and parsed as a stream, one line in memory at a time.

A `.zst` file cut short (an interrupted download) ends inside a frame; the zstandard
library's stream reader would silently return nothing more, so frames are decoded here
with a decompression object whose end-of-frame flag tells a truncated file apart."""
from __future__ import annotations

import gzip
import io
from typing import Iterator, List, Optional

import zstandard

from pretrain.data.corpus_files import jsonl_texts
from pretrain.data.sources.sharded import Piece, Shard, ShardedTextSource, open_binary

_CHUNK = 1 << 20


class TruncatedError(IOError):
  """A compressed stream ended before its last frame did."""


class _ZstdReader(io.RawIOBase):
  """The decompressed bytes of a (multi-frame) `.zst` file, read in chunks."""

  def __init__(self, raw):
    super().__init__()
    self._raw = raw
    self._decompressor = zstandard.ZstdDecompressor()
    self._frame = self._decompressor.decompressobj()
    self._buffer = b""
    self._in_frame = False

  def readable(self):
    return True

  def readinto(self, target):
    while not self._buffer:
      chunk = self._raw.read(_CHUNK)
      if not chunk:
        if self._in_frame:
          raise TruncatedError("the file ends inside a zstd frame (it is truncated)")
        return 0
      while chunk:
        self._in_frame = True
        self._buffer += self._frame.decompress(chunk)
        if self._frame.eof:
          chunk = self._frame.unused_data
          self._frame = self._decompressor.decompressobj()
          self._in_frame = False
        else:
          chunk = b""
    n = min(len(target), len(self._buffer))
    target[:n] = self._buffer[:n]
    self._buffer = self._buffer[n:]
    return n

  def close(self):
    self._raw.close()
    super().close()


def open_text_lines(path: str):
  """A text stream of a `.jsonl`, `.jsonl.gz` or `.jsonl.zst` file (local or URL)."""
  raw = open_binary(path)
  if path.endswith(".gz"):
    raw = gzip.GzipFile(fileobj=raw, mode="rb")
  elif path.endswith(".zst"):
    raw = io.BufferedReader(_ZstdReader(raw), buffer_size=_CHUNK)
  return io.TextIOWrapper(raw, encoding="utf-8")


class JsonlDataSource(ShardedTextSource):
  """Documents from the `text_field` of every non-blank line of JSONL files."""
  FORMAT = "JSONL"
  SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst")

  def _pieces(self, shard: Shard) -> List[Piece]:
    """The whole file: a compressed stream cannot be split (gzip and zstd frames carry
    no index of where lines start), so a file is read by one worker, start to end."""
    with open_binary(shard.path) as f:  # exists and is readable; the rest streams
      f.read(1)
    return [Piece(shard)]

  def _texts(self, piece: Piece) -> Iterator[Optional[str]]:
    task = self._flag.split(".")[0]
    with open_text_lines(piece.shard.path) as lines:
      yield from jsonl_texts(lines, piece.shard.path, self.text_field,
                             f"set {task}.text_field to the field that holds the text")
