"""Finding and reading corpus files, without TensorFlow (the tokenizer CLI uses this).

A glob selects the corpus: every matched file is one document, except `.jsonl` files,
where every line is a JSON object whose `text` field is one document. The placeholder
`{stdlib}` expands to the running Python's standard-library directory, a real corpus
present on every machine (the quickstart's). `corpus_format` tells the shipped corpus
formats (`pretrain.data.sources`) from their names.
"""
from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
import sysconfig
from typing import Iterable, Iterator, List, Optional, Sequence

from plumbing import storage
from pretrain.data.errors import DataError

# Third-party packages installed into the interpreter live under the standard-library
# directory; they are not part of the stdlib corpus and vary between machines.
DEFAULT_EXCLUDE = ("*/site-packages/*", "*/dist-packages/*", "*/__pycache__/*")
# Text per input shard: shards are packed (and prepared by Beam workers) separately.
DEFAULT_SHARD_BYTES = 4 << 20
# Parquet text per input shard (whole row groups): every shard pays about 2 CPU-seconds
# of tf.data and SeqIO set-up before its first document (measured on the 2-core box,
# benchmarks/RESULTS.md "Reading corpora"; tokenizing runs at about 10 MB of text per
# CPU-second), so a shard holds enough text to keep that under a tenth.
PARQUET_SHARD_BYTES = 256 << 20
_GLOB_CHARS = "*?["
# format -> the file-name suffixes it reads from a directory (`pretrain.data.sources`)
FORMATS = {
    "parquet": (".parquet",),
    "jsonl": (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst"),
    "hf_dataset": (),
}


def expand_pattern(pattern: str) -> str:
  """Expands `{stdlib}` and `~` in a glob pattern."""
  stdlib = sysconfig.get_paths()["stdlib"]
  return os.path.expanduser(pattern.replace("{stdlib}", stdlib))


def corpus_format(location: str) -> Optional[str]:
  """The corpus format a location names (`FORMATS`), or None when its name does not say:
  `.parquet` or `.jsonl[.gz|.zst]` files (a glob, one file, or a directory holding
  them), or a `datasets` `save_to_disk` directory (it holds `state.json` or
  `dataset_dict.json`)."""
  name = expand_pattern(location).rstrip("/")
  for fmt, suffixes in FORMATS.items():
    if any(name.endswith(s) for s in suffixes):
      return fmt
  if any(c in name for c in _GLOB_CHARS):
    return None
  if (storage.exists(storage.join(name, "state.json"))
      or storage.exists(storage.join(name, "dataset_dict.json"))):
    return "hf_dataset"
  if storage.isdir(name):
    names = storage.list_files(name)
    for fmt, suffixes in FORMATS.items():
      if suffixes and any(n.endswith(s) for n in names for s in suffixes):
        return fmt
  return None


def glob_root(pattern: str) -> str:
  """The directory prefix of a pattern that holds no wildcard."""
  parts = pattern.split(os.sep)
  fixed = []
  for part in parts[:-1]:
    if any(c in part for c in _GLOB_CHARS):
      break
    fixed.append(part)
  return os.sep.join(fixed) or os.curdir


def match_files(pattern: str, exclude: Sequence[str] = DEFAULT_EXCLUDE,
                flag: str = "TRAIN_FILES") -> List[str]:
  """Sorted regular files matching `pattern` (recursive `**`) minus `exclude` globs.

  `flag` names the setting the pattern came from, for the error message.
  """
  expanded = expand_pattern(pattern)
  files = sorted(
      path for path in glob.glob(expanded, recursive=True)
      if os.path.isfile(path)
      and not any(fnmatch.fnmatch(path, ex) for ex in exclude))
  if not files:
    if flag.isupper():  # a Gin macro
      where = f"{flag} glob '{pattern}'"
      fix = f"--gin_param=\"{flag}='/path/to/**/*.txt'\""
    else:  # a command-line flag
      where = f"--{flag}='{pattern}'"
      fix = f"--{flag}='/path/to/**/*.txt'"
    raise DataError(
        f"{where} matched no files; check the path or set {fix}")
  return files


def _unit_interval_hash(key: str) -> float:
  """A stable pseudo-random number in [0, 1) for a document key."""
  digest = hashlib.sha256(key.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "little") / 2.0**64


def assign_validation(keys: Sequence[str], fraction: float) -> List[bool]:
  """Marks each key as validation (True) or train (False), deterministically.

  A key goes to validation when its hash falls below `fraction`. Tiny corpora still
  get both splits: with at least two documents and `fraction > 0`, the document with
  the smallest hash is validation and the one with the largest is train.
  """
  if not 0.0 <= fraction < 1.0:
    raise DataError(
        f"validation_fraction={fraction} must be in [0, 1); e.g. 0.02")
  hashes = [_unit_interval_hash(k) for k in keys]
  is_validation = [h < fraction for h in hashes]
  if fraction > 0 and len(keys) >= 2:
    is_validation[min(range(len(keys)), key=hashes.__getitem__)] = True
    is_validation[max(range(len(keys)), key=hashes.__getitem__)] = False
  return is_validation


def iter_jsonl_texts(path: str, field: str = "text") -> Iterator[str]:
  """The `field` of every non-blank line of a JSONL file, one line in memory at a
  time (a corpus file may be many gigabytes)."""
  with open(path, "r", encoding="utf-8") as f:
    yield from jsonl_texts(f, path, field, allow_null=False)


def jsonl_texts(lines: Iterable[str], path: str, field: str = "text",
                fix: Optional[str] = None, allow_null: bool = True
                ) -> Iterator[Optional[str]]:
  """The `field` of every non-blank line (None where it is null, if `allow_null`); a
  DataError naming
  `path`, the line and `fix` (how to choose another field) for a bad line."""
  fix = fix or f"every line of a .jsonl file must look like {{\"{field}\": \"...\"}}"
  for line_number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(
          f"{path}:{line_number} is not valid JSON ({e.msg}); every line must be a "
          f"JSON object with a '{field}' field") from None
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(record, dict) or field not in record or not (
        (text is None and allow_null) or isinstance(text, str)):
      has = ", ".join(record) if isinstance(record, dict) else type(record).__name__
      raise DataError(
          f"{path}:{line_number} has no string '{field}' field (it has: {has}); {fix}")
    yield text
