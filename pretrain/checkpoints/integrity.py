"""Checkpoints that prove their own integrity: a manifest of checksums in every step.

Orbax commits a step once every file is written, but nothing in the step tells later
whether its bytes are still the ones written. A torn copy or bit rot of an array's data
file either fails deep inside tensorstore (a truncated file: `OUT_OF_RANGE ... in OCDBT
database`) or, when the size is unchanged, restores different numbers without a word
(zarr's chunks carry no checksum in the format Orbax writes). So each step directory,
of both tiers, holds `integrity.json`: the size and CRC32C of every file of the step,
written after the last array byte and before Orbax commits the step (from Orbax's
post-finalization callback), and checked before the step is restored.

Files Orbax writes into the step directory after the manifest (its commit marker, and
`_CHECKPOINT_METADATA`, which it stamps with the commit time) are not covered; every
other file is. A step without a manifest (written before manifests existed, or a
process that died between the commit and the manifest of a synchronous save) is
readable but unverified; only a failed read tells it is damaged.

CRC32C (hardware-accelerated in `google_crc32c`, which the GCS client already needs)
detects every torn copy and bit flip a storage system produces; it is not a defence
against someone who edits a checkpoint on purpose. The cost is one extra read of the
step's files after each save (in Orbax's background thread, from the page cache on a
local disk) and one before each restore: `benchmarks/checkpoint_integrity.py` measures
both at a preset's size. On `gs://` nothing is read back: GCS keeps the CRC32C of every
object it stores and lists it, so the manifest records and the check compares those
(proving the objects unchanged since the save, which is the point); on `s3://` the files
are downloaded and hashed.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import json
import os
import time
from typing import Any, Collection, Iterator, Optional

import google_crc32c

from plumbing import storage
from plumbing.errors import CheckpointSaveError, UserError

MANIFEST = "integrity.json"
FORMAT = 1
COMMIT_MARKER = "commit_success.txt"
# Written by Orbax into the step directory after the manifest.
NOT_COVERED = frozenset({MANIFEST, COMMIT_MARKER, "_CHECKPOINT_METADATA"})
# Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it when committed
# (on local disks; object storage commits in place, by the marker).
TMP_SUFFIX = ".orbax-checkpoint-tmp"
CHUNK_BYTES = 16 << 20
HASH_THREADS = 8   # reads overlap: object storage answers each request slowly
SETTLE_S = 0.1          # see `remove_partial`
SETTLE_TIMEOUT_S = 10.0
FULL_BELOW_BYTES = 1 << 20   # free space of a disk that counts as full
CLOSE_ATTEMPTS = 4  # a failed save's copies of its error, at most (see `close_failed`)
# Errors of our own code, not of the bytes read or the storage written to.
BUGS = (TypeError, AttributeError, NameError, AssertionError, NotImplementedError)
# A read failed for one of these reasons says nothing about the checkpoint's bytes:
# the storage did not answer or refused (tensorstore's status codes, Python's types).
TRANSIENT_STATUS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "PERMISSION_DENIED",
                    "UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "ABORTED", "CANCELLED")
NOT_ABOUT_DATA = BUGS + (ConnectionError, TimeoutError, PermissionError, MemoryError,
                         UserError)
# Failures of a write that have a short name, by errno and by the text tensorstore
# quotes from the OS.
WRITE_FAILURES = ((errno.ENOSPC, "No space left on device", "no space left on device"),
                  (errno.EDQUOT, "Disk quota exceeded", "disk quota exceeded"),
                  (errno.EACCES, "Permission denied", "permission denied"),
                  (errno.EROFS, "Read-only file system", "read-only file system"))


@dataclasses.dataclass(frozen=True)
class Problem:
  """Why a step cannot be used.

  Attributes:
    kind: "size", "checksum", "missing", "manifest" or "unreadable"; a step set aside
      is renamed `<step>.corrupt-<kind>`.
    detail: the file and what is wrong with it, one line.
  """
  kind: str
  detail: str


def crc32c(path: str) -> str:
  """The CRC32C of the file at `path`, as 8 hex digits, read in pieces."""
  checksum = google_crc32c.Checksum()
  with storage.open_read(path) as f:
    while chunk := f.read(CHUNK_BYTES):
      checksum.update(chunk)
  return checksum.hexdigest().decode("ascii")


def _checksums(step_dir: str, names: list[str]) -> list[str]:
  """The CRC32C of each file: on `gs://` the one GCS keeps of each object (no download);
  elsewhere read and computed here."""
  stored = storage.stored_crc32c(step_dir)
  unknown = [name for name in names if name not in stored]
  with concurrent.futures.ThreadPoolExecutor(HASH_THREADS) as pool:
    computed = dict(zip(unknown, pool.map(
        lambda name: crc32c(storage.join(step_dir, name)), unknown)))
  return [stored.get(name) or computed[name] for name in names]


def write_manifest(step_dir: str) -> None:
  """Writes `step_dir/integrity.json`: size and CRC32C of every file in the step."""
  sizes = {name: size for name, size in storage.list_files(step_dir).items()
           if name not in NOT_COVERED}
  names = sorted(sizes)
  files = {name: {"bytes": sizes[name], "crc32c": checksum}
           for name, checksum in zip(names, _checksums(step_dir, names))}
  storage.write_text(storage.join(step_dir, MANIFEST),
                     json.dumps({"format": FORMAT, "files": files}, indent=1) + "\n")


def seal(directory: str, step: int) -> None:
  """Writes the manifest of `step`, whose files are all written and which Orbax is
  about to commit: in its temporary directory (renamed to `<step>` with the manifest
  in it) or, where Orbax commits in place, in `<step>`."""
  pending = sorted(name for name in storage.listdir(directory)
                   if name.startswith(f"{step}{TMP_SUFFIX}"))
  step_dir = storage.join(directory, pending[-1] if pending else str(step))
  if not storage.isdir(step_dir):
    raise FileNotFoundError(f"no directory of step {step} in {directory} to seal")
  write_manifest(step_dir)


def verify(step_dir: str, items: Optional[Collection[str]] = None,
           share: tuple[int, int] = (0, 1)) -> Optional[Problem]:
  """The first problem of the step's files against its manifest; None when they match
  or there is no manifest (an unverified step).

  Only the files of `items` (the step's top-level directories; None: all) are checked,
  and of those every `share[1]`-th from the `share[0]`-th, so that processes reading
  shared storage split the work. Sizes are compared first (one listing), then
  checksums.
  """
  path = storage.join(step_dir, MANIFEST)
  if not storage.exists(path):
    return None
  try:
    listed = json.loads(storage.read_text(path))["files"]
    names = sorted(name for name in listed
                   if items is None or name.split("/", 1)[0] in items)
    names = names[share[0]::share[1]]
    expected = {name: (int(listed[name]["bytes"]), str(listed[name]["crc32c"]))
                for name in names}
  except (ValueError, KeyError, TypeError):
    return Problem("manifest", f"{MANIFEST} is damaged")
  present = storage.list_files(step_dir)
  for name in names:
    size = expected[name][0]
    if name not in present:
      return Problem("missing", f"{name} is missing")
    if present[name] != size:
      return Problem("size", f"{name} has {present[name]:,} bytes, {size:,} expected")
  for name, checksum in zip(names, _checksums(step_dir, names)):
    if checksum != expected[name][1]:
      return Problem("checksum", f"{name} fails its checksum")
  return None


def _chain(error: BaseException) -> list[BaseException]:
  """`error` and the exceptions it was raised from, outermost first."""
  chain = [error]
  while True:
    last = chain[-1]
    cause = last.__cause__ or (None if last.__suppress_context__ else last.__context__)
    if cause is None or cause in chain:
      return chain
    chain.append(cause)


def _one_line(error: BaseException, limit: int = 240) -> str:
  text = " ".join(str(error).split()) or type(error).__name__
  return text if len(text) <= limit else text[:limit] + "..."


def read_problem(error: BaseException) -> Optional[Problem]:
  """The problem a failed read of a checkpoint shows, when the failure means the
  checkpoint's bytes are bad (a truncated or missing file, JSON or metadata that do not
  parse); None for anything else (our bug, a storage that did not answer or refused,
  a UserError), which must not get a good checkpoint set aside."""
  chain = _chain(error)
  if not isinstance(error, Exception) or any(isinstance(e, NOT_ABOUT_DATA) for e in chain):
    return None
  if any(status in str(e) for e in chain for status in TRANSIENT_STATUS):
    return None
  return Problem("unreadable", _one_line(chain[-1]))


def write_failure(error: BaseException) -> Optional[str]:
  """What made a save fail, in a few words ("no space left on device", or the
  innermost error's message); None when the error is a bug of ours, which keeps its
  traceback."""
  chain = _chain(error)
  if not isinstance(error, Exception) or any(isinstance(e, BUGS) for e in chain):
    return None
  for number, text, reason in WRITE_FAILURES:
    if any(getattr(e, "errno", None) == number or text in str(e) for e in chain):
      return reason
  return _one_line(chain[-1])


@contextlib.contextmanager
def save_failures(step: int, directory: str, local: bool = False) -> Iterator[None]:
  """Turns a failure of saving `step` under `directory` inside the block into a
  CheckpointSaveError naming it in a few words (our own bugs keep their traceback)."""
  try:
    yield
  except Exception as error:  # pylint: disable=broad-except  # storage errors of every kind
    reason = write_failure(error)
    if reason is None:
      raise
    if _out_of_space(str(directory)):
      reason = WRITE_FAILURES[0][2]
    raise CheckpointSaveError(step, reason, str(directory), local) from error


def _out_of_space(directory: str) -> bool:
  """Whether the local file system of `directory` is (all but) full. A full disk also
  fails writes indirectly (a directory that could not be created is missing to the
  next write, which fails as "No such file"), so the free space names the cause."""
  if storage.is_url(directory):
    return False
  try:
    stats = os.statvfs(directory)
  except OSError:
    return False
  return stats.f_bavail * stats.f_frsize < FULL_BELOW_BYTES


def close_failed(manager: Any) -> None:
  """Closes an Orbax CheckpointManager whose save failed. Orbax keeps that failure in
  each thread the save ran in (the finalize thread, the array writer, the metadata
  store) and raises each copy once, at whichever call comes next: the first copy was
  reported, the others are dropped here (each close gets past one more of them)."""
  for _ in range(CLOSE_ATTEMPTS):
    try:
      manager.close()
      return
    except Exception:  # pylint: disable=broad-except  # a copy of the reported failure
      continue


def _partial(directory: str, step: int) -> list[str]:
  """What a failed save of `step` left in `directory`: Orbax's temporary directory, or,
  where Orbax commits in place, the step directory without its commit marker."""
  paths = []
  for name in storage.listdir(directory):
    path = storage.join(directory, name)
    if name.startswith(f"{step}{TMP_SUFFIX}") or (
        name == str(step) and not storage.exists(storage.join(path, COMMIT_MARKER))):
      paths.append(path)
  return paths


def remove_partial(directory: str, step: int) -> None:
  """Deletes what a failed save of `step` left in `directory`, freeing its space
  before the save is tried again. Orbax reports the first write that failed while
  tensorstore still completes the save's other writes, which can recreate files just
  deleted; so it deletes until two passes `SETTLE_S` apart find nothing (for at most
  `SETTLE_TIMEOUT_S`)."""
  deadline = time.monotonic() + SETTLE_TIMEOUT_S
  clean_passes = 0
  while clean_passes < 2 and time.monotonic() < deadline:
    leftovers = _partial(directory, step)
    for path in leftovers:
      try:
        storage.rmtree(path)
      except OSError:  # a late write changed the tree under the deletion: next pass
        pass
    clean_passes = 0 if leftovers else clean_passes + 1
    time.sleep(SETTLE_S)


def set_aside(directory: str, step: int, kind: str) -> str:
  """Renames step directory `<step>` to `<step>.corrupt-<kind>` (`-2`, `-3`, ... when
  taken): Orbax no longer lists it, nothing deletes it, and it is there to inspect.
  Returns the new name."""
  taken = set(storage.listdir(directory))
  name, number = f"{step}.corrupt-{kind}", 2
  while name in taken:
    name, number = f"{step}.corrupt-{kind}-{number}", number + 1
  storage.move_tree(storage.join(directory, str(step)), storage.join(directory, name))
  return name
