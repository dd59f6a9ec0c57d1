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
  """The decompressed bytes of a (multi-frame) `.zst` file, read in chunks. Each chunk
  is decompressed once and handed out from an offset: slicing the rest of a chunk off
  after every read copied it again and again (at a zstd ratio of 16, a 1 MiB chunk is
  16 MiB), 12 times slower than zstandard's own reader."""

  def __init__(self, raw):
    super().__init__()
    self._raw = raw
    self._decompressor = zstandard.ZstdDecompressor()
    self._frame = self._decompressor.decompressobj()
    self._buffer = b""
    self._offset = 0
    self._in_frame = False

  def readable(self):
    return True

  def readinto(self, target):
    while self._offset == len(self._buffer):
      chunk = self._raw.read(_CHUNK)
      if not chunk:
        if self._in_frame:
          raise TruncatedError("the file ends inside a zstd frame (it is truncated)")
        return 0
      parts = []
      while chunk:
        self._in_frame = True
        parts.append(self._frame.decompress(chunk))
        if self._frame.eof:
          chunk = self._frame.unused_data
          self._frame = self._decompressor.decompressobj()
          self._in_frame = False
        else:
          chunk = b""
      self._buffer, self._offset = b"".join(parts), 0
    n = min(len(target), len(self._buffer) - self._offset)
    target[:n] = memoryview(self._buffer)[self._offset:self._offset + n]
    self._offset += n
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
    with open_text_lines(piece.shard.path) as lines:
      yield from jsonl_texts(
          lines, piece.shard.path, self.text_field,
          f"set {self.setting('text_field')} to the field that holds the text")
