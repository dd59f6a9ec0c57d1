"""What the Parquet, compressed-JSONL and `datasets`-directory sources share.

A source is a glob, a directory (every file under it with the format's suffix) or one
file, local or `gs://` / `s3://`. The files are cut into pieces, the units of work that
are packed separately and in parallel by `pretrain.data.prepare`: a Parquet file into
runs of whole row groups (`ParquetDataSource.shard_bytes` of text each), so one large file
still keeps many Beam workers busy; a JSONL or Arrow file is one piece. Every piece is
one input shard (`num_shards`, capped at `MAX_SHARDS`: then shard i reads pieces i, i+n,
...). A document's split is decided by a hash of `<file relative to the source root>:<row
in the file>`, so both splits stream without a first pass over the corpus, are the same
on every machine and do not depend on how files are cut into pieces.

A shard that cannot be read (a corrupt Parquet footer, a truncated `.zst`) stops the
build with one line naming it: the store is not committed, so a run never starts on
part of the data. `skip_bad_shards=True` instead warns (one stderr line per shard) and
trains on what is readable.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import glob
import hashlib
import json
import os
from typing import Iterator, List, Optional, Sequence, Tuple

import fsspec
import seqio
import tensorflow as tf

from plumbing import storage
from plumbing.errors import warn
from pretrain.data.corpus_files import FORMATS, corpus_format, expand_pattern, glob_root
from pretrain.data.errors import DataError

TRAIN = "train"
VALIDATION = "validation"
MAX_SHARDS = 4096
SHUFFLE_BUFFER = 10_000
_GLOB_CHARS = "*?["


@dataclasses.dataclass(frozen=True)
class Shard:
  """One file of a source."""
  path: str   # local path or URL
  key: str    # relative to the source's root: the stable part of document keys
  size: int
  stamp: str  # mtime (local) or the object's generation / update time


@dataclasses.dataclass(frozen=True)
class Piece:
  """A unit of work: a whole file, or (Parquet) its row groups [first_group, end_group),
  whose first row is row `first_row` of the file."""
  shard: Shard
  first_group: int = 0
  end_group: Optional[int] = None   # None: to the end of the file
  first_row: int = 0


def detect_format(location: str) -> str:
  """The format of a source from its name (`corpus_files.corpus_format`), or a DataError
  asking for `corpus_task.format`."""
  fmt = corpus_format(location)
  if fmt is None:
    raise DataError(
        f"cannot tell the format of corpus '{location}'; name .parquet or .jsonl[.gz|.zst] "
        "files (a glob or a directory of them) or a `save_to_disk` directory, or set "
        "corpus_task.format to one of " + ", ".join(sorted(FORMATS)))
  return fmt


def _is_glob(path: str) -> bool:
  return any(c in path for c in _GLOB_CHARS)


def list_shards(location: str, suffixes: Sequence[str], flag: str) -> List[Shard]:
  """The files of a source, sorted; a DataError naming `flag` when there are none."""
  expanded = expand_pattern(location)
  found: List[Tuple[str, str, int, str]] = []
  single_file = False
  if storage.is_url(expanded):
    fs, root_path = fsspec.core.url_to_fs(expanded.rstrip("/"))
    scheme = expanded.split("://", 1)[0]
    def listing():
      if _is_glob(root_path):
        return fs.glob(root_path, detail=True), glob_root(root_path)
      if fs.isdir(root_path):
        return fs.find(root_path, detail=True), root_path
      return ({root_path: fs.info(root_path)} if fs.exists(root_path) else {},
              os.path.dirname(root_path))
    infos, base = storage.guarded(expanded, listing)
    single_file = not _is_glob(root_path) and list(infos) == [root_path]
    for path, info in infos.items():
      if info.get("type", "file") != "file":
        continue
      stamp = str(info.get("generation") or info.get("updated") or info.get("mtime")
                  or info.get("LastModified") or info.get("ETag") or "")
      found.append((f"{scheme}://{path}", os.path.relpath(path, base),
                    int(info.get("size") or 0), stamp))
  else:
    if _is_glob(expanded):
      paths, base = glob.glob(expanded, recursive=True), glob_root(expanded)
    elif os.path.isdir(expanded):
      base = expanded
      paths = [os.path.join(parent, name) for parent, _, names in os.walk(expanded)
               for name in names]
    else:
      paths, base = ([expanded] if os.path.exists(expanded) else []), os.path.dirname(
          expanded)
      single_file = True
    for path in paths:
      if os.path.isfile(path):
        st = os.stat(path)
        found.append((path, os.path.relpath(path, base), st.st_size, str(st.st_mtime_ns)))
  if suffixes and not single_file:
    found = [f for f in found if any(f[0].endswith(s) for s in suffixes)]
  found = [f for f in found if not fnmatch.fnmatch(os.path.basename(f[0]), ".*")]
  if not found:
    raise DataError(
        f"{flag}='{location}' matched no {'/'.join(suffixes) or 'data'} files; check the "
        f"path (a glob such as '/data/*.parquet', a directory of shards or one file)")
  return [Shard(*f) for f in sorted(found)]


def _in_validation(key: str, fraction: float) -> bool:
  if fraction <= 0:
    return False
  digest = hashlib.sha256(key.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "little") / 2.0**64 < fraction


class FileListSource(seqio.DataSource):
  """A source whose input shards are its files (`files`, defined by subclasses).

  `files_setting` and `fraction_setting` name the Gin settings a user edits to change
  the files and the held-out fraction, so errors point at the task's own knobs.
  """
  files_setting = "the task's files"
  fraction_setting = "the task's validation_fraction"
  _fraction = 0.0

  @property
  def validation_fraction(self) -> float:
    return self._fraction

  @property
  def files(self) -> Tuple[str, ...]:
    raise NotImplementedError

  @property
  def supports_arbitrary_sharding(self) -> bool:
    return False

  def list_shards(self, split: str) -> Sequence[str]:
    return list(self.files)

  def num_input_examples(self, split: str) -> Optional[int]:
    return None


class ShardedTextSource(FileListSource):
  """Documents (`{"text": tf.string}`) from the files of one source. Subclasses define
  `_pieces(shard)` (cheap: a footer or schema; raises on an unusable shard; returns the
  file's pieces) and `_texts(piece)` (yields each row's text or None for a row without
  text)."""
  FORMAT = ""
  SUFFIXES: Tuple[str, ...] = ()

  def __init__(self, location: str, text_field: str = "text",
               validation_fraction: float = 0.0, skip_bad_shards: bool = False,
               flag: str = "corpus_task.files"):
    if not 0.0 <= validation_fraction < 1.0:
      raise DataError(f"validation_fraction={validation_fraction} must be in [0, 1); "
                      "e.g. 0.01")
    self._location = location
    self.text_field = text_field
    self._fraction = float(validation_fraction)
    self.skip_bad_shards = bool(skip_bad_shards)
    self._flag = flag
    # The task's own settings, for messages: `corpus_task.files` (scoped in a mixture).
    self.files_setting = f"{flag} (CORPUS)" if flag == "corpus_task.files" else flag
    self.fraction_setting = flag.rsplit(".", 1)[0] + ".validation_fraction"
    usable, pieces = [], []
    for shard in self._list(location, flag):
      try:
        pieces += self._pieces(shard)
      except DataError:
        raise
      except Exception as error:  # pylint: disable=broad-except
        problem = self._problem(shard, error)
        if not self.skip_bad_shards:
          raise DataError(self._bad_shard_message(problem)) from None
        warn(f"skipping {problem}")
        continue
      usable.append(shard)
    if not usable:
      raise DataError(f"{flag}='{location}': no readable shard is left")
    self._shards = tuple(usable)
    self._work = tuple(pieces)
    super().__init__(splits=(TRAIN, VALIDATION) if self._fraction > 0 else (TRAIN,))

  def _list(self, location: str, flag: str) -> List[Shard]:
    return list_shards(location, self.SUFFIXES, flag)

  def setting(self, name: str) -> str:
    """Where a user sets the source's option `name`: beside its files setting
    (`web/corpus_task.text_field`), or a command's flag (`--text_field`) when the files
    came from one (`flag='--input_glob'`)."""
    if self._flag.startswith("--"):
      return f"--{name}"
    return f"{self._flag.rsplit('.', 1)[0]}.{name}"

  def _bad_shard_message(self, problem: str) -> str:
    if self._flag.startswith("--"):   # a command reads every shard or stops
      return f"{problem}; replace or delete that shard"
    return (f"{problem}; replace or delete that shard, or set "
            f"{self.setting('skip_bad_shards')}=True to train without it")

  def _problem(self, shard: Shard, error: Exception) -> str:
    """One line naming the shard and what reading it raised."""
    detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return (f"shard {shard.path} is not a readable {self.FORMAT} file "
            f"({type(error).__name__}{': ' + detail if detail else ''})")

  # --- to define in subclasses
  def _pieces(self, shard: Shard) -> List[Piece]:
    raise NotImplementedError

  def _texts(self, piece: Piece) -> Iterator[Optional[str]]:
    raise NotImplementedError

  # --- seqio.DataSource
  @property
  def files(self) -> Tuple[str, ...]:
    return tuple(s.path for s in self._shards)

  @property
  def num_shards(self) -> int:
    return max(1, min(len(self._work), MAX_SHARDS))

  @property
  def fingerprint(self) -> str:
    """Changes when the files, a file's size or stamp, the pieces, the field or the
    split change."""
    h = hashlib.sha256()
    h.update(json.dumps([self.FORMAT, self.text_field, self._fraction,
                         self.skip_bad_shards]).encode())
    for s in self._shards:
      h.update(f"{s.key}\0{s.size}\0{s.stamp}\n".encode())
    for p in self._work:
      h.update(f"{p.shard.key}\0{p.first_group}\0{p.end_group}\n".encode())
    return h.hexdigest()

  def piece_texts(self, piece: Piece) -> Iterator[Tuple[int, str]]:
    """(row in the file, text) of the piece's rows that have a text; a DataError (or,
    with `skip_bad_shards`, a warning and the end of the piece) when the file turns out
    unreadable part way."""
    iterator = self._texts(piece)
    row = piece.first_row
    while True:
      try:
        text = next(iterator)
      except StopIteration:
        return
      except DataError:
        raise
      except Exception as error:  # pylint: disable=broad-except
        problem = self._problem(piece.shard, error)
        if self.skip_bad_shards:
          warn(f"skipping the rest of {problem}")
          return
        raise DataError(self._bad_shard_message(problem)) from None
      if text is not None:
        yield row, text
      row += 1

  def split_texts(self, split: str, shard_info: Optional[seqio.ShardInfo] = None
                  ) -> Iterator[str]:
    """The split's documents in file and row order (with `shard_info`, only the pieces
    of that shard)."""
    pieces = self._work
    if shard_info is not None:
      pieces = pieces[shard_info.index::shard_info.num_shards]
    for piece in pieces:
      for row, text in self.piece_texts(piece):
        if _in_validation(f"{piece.shard.key}:{row}", self._fraction) == (
            split == VALIDATION):
          yield text

  def get_dataset(self, split: str = TRAIN, shuffle: bool = True,
                  seed: Optional[int] = None,
                  shard_info: Optional[seqio.ShardInfo] = None) -> tf.data.Dataset:
    if split not in self.splits:
      raise DataError(
          f"{self.FORMAT} source '{self._location}' has no split '{split}' (splits: "
          f"{self.splits}); set {self.fraction_setting} > 0 for a validation split")
    ds = tf.data.Dataset.from_generator(
        lambda: ({"text": t} for t in self.split_texts(split, shard_info)),
        output_signature={"text": tf.TensorSpec((), tf.string)})
    if shuffle:
      ds = ds.shuffle(SHUFFLE_BUFFER, seed=seed)
    return ds


def open_binary(path: str):
  """A binary file object of a local path or URL."""
  return open(path, "rb") if not storage.is_url(path) else storage.open_read(path)


def missing_field(path: str, field: str, available: Sequence[str], setting: str
                  ) -> DataError:
  return DataError(
      f"{path} has no column '{field}' (it has: {', '.join(available) or 'none'}); set "
      f"{setting} to the column that holds the text")


