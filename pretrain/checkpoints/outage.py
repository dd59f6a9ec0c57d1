"""Object storage that goes away and comes back: writes retried with backoff, in the
background, for up to `StorageConfig.outage_s`, while training continues.

A bucket can stop answering for minutes (a network partition, a zonal incident, an
emulator restarted) and then answer again with its contents intact. A run whose every
write to it failed at once would stop for nothing; a run that waited inside each write
would stop training for as long. So the writes the loop makes to a bucket workdir
between checkpoints (`metrics.jsonl`, TensorBoard uploads) go through `Uploads`: one
background thread runs them, the newest version of a file replacing an older one not yet
written (each write is a whole file), and a write that fails is tried again after a
backoff of 1, 2, 4, ... seconds (at most `MAX_BACKOFF_S`). The loop never waits for
them. Once the storage has failed every attempt for `outage_s` seconds, `check` (called
by the loop's next write) raises `StorageOutageError`, a one-line UserError; the trainer
then saves the local tier, when it has one, and stops (exit 1) (checkpoint saves:
`pretrain.checkpoints.policies.Essential`, with the same `Outage` clock).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Optional

from plumbing import storage
from plumbing.errors import StorageOutageError, UserError

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
FLUSH_TIMEOUT_S = 60.0   # what `close` waits for the last writes, at most
# What a session's end waits for the writes still queued (`Uploads.drain`) when their
# storage answers the probe; one that does not answer it is not waited for at all.
EXIT_FLUSH_S = 10.0


@dataclasses.dataclass(frozen=True)
class StorageConfig:
  """How long object storage may be unreachable before the run stops.

  Attributes:
    outage_s: writes to a bucket (checkpoint saves, `metrics.jsonl`, TensorBoard
      uploads) that fail are retried with backoff while training continues, for up to
      this many seconds of continuous failure; then the run saves its local tier (if
      any) and stops with one line (exit 1).
  """
  outage_s: float = 300.0

  def __post_init__(self):
    if not self.outage_s >= 0:
      raise ValueError(f"StorageConfig.outage_s must be >= 0, got {self.outage_s}")


class Outage:
  """Since when writes to one storage have failed without a success in between.

  Args:
    outage_s: how long failures may go on before `failed` raises.
    clock: seconds, monotonic (tests pass their own).
  """

  def __init__(self, outage_s: float, clock: Callable[[], float] = time.monotonic):
    self.outage_s = outage_s
    self._clock = clock
    self.since: Optional[float] = None
    self._failures = 0

  @property
  def ongoing(self) -> bool:
    return self.since is not None

  def succeeded(self) -> None:
    self.since, self._failures = None, 0

  def down_s(self) -> float:
    """Seconds since the first failure of the current outage (0 when none)."""
    return 0.0 if self.since is None else self._clock() - self.since

  def failed(self, error: BaseException, what: str,
             started: Optional[float] = None) -> float:
    """Counts a failure of `what`, an attempt begun at `started` (clients retry inside
    one call for a while: the outage began no later than that); returns the backoff
    before the next attempt. Raises StorageOutageError once failures have gone on for
    longer than `outage_s`."""
    now = self._clock()
    if self.since is None:
      self.since = now if started is None else min(started, now)
    self._failures += 1
    if now - self.since > self.outage_s:
      raise StorageOutageError(what, now - self.since, self.outage_s, error)
    return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (self._failures - 1))


class Uploads:
  """Whole-file writes to object storage in one background thread, retried with backoff.

  `submit(key, write)` queues `write` (it replaces a queued, not yet started write of the
  same `key`: each write is a whole new version of a file). The thread runs the queue in
  order; a write that fails (a `UserError` from `plumbing.storage`, which is how every
  client failure surfaces) is retried after the `Outage` backoff, and later writes wait
  behind it, so a file's versions land in order. `check` raises the outage's
  `StorageOutageError` in the caller's thread once it has lasted `outage_s`, and so
  it does when one write has not returned for `outage_s` (a storage that accepts
  connections and stalls: the client would wait for its own timeouts and retries,
  minutes, before the write failed and the outage began).
  """

  def __init__(self, outage_s: float):
    self.outage = Outage(outage_s)
    self._queue: dict[str, Callable[[], None]] = {}
    self._condition = threading.Condition()
    self._busy = False
    self._writing: Optional[tuple[str, float]] = None   # the write in flight, since when
    self._error: Optional[StorageOutageError] = None
    self._closed = False
    self._abandoned = False   # a drain found the storage silent: the next waits for nothing
    self._thread = threading.Thread(target=self._run, name="uploads", daemon=True)
    self._thread.start()

  def submit(self, key: str, write: Callable[[], None]) -> None:
    self.check()
    with self._condition:
      self._queue.pop(key, None)
      self._queue[key] = write
      self._condition.notify_all()

  def check(self) -> None:
    """Raises the StorageOutageError of an outage longer than `outage_s`, or of a write
    in flight for longer than that."""
    if self._error is not None:
      raise self._error
    writing = self._writing
    if writing is not None and time.monotonic() - writing[1] > self.outage.outage_s:
      key, started = writing   # keys are the files' URLs: ask their storage why
      reason = storage.reachable(key) or "the storage has not finished a write"
      raise StorageOutageError(key, time.monotonic() - started, self.outage.outage_s,
                               UserError(reason))

  def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
    """Waits until every queued write has landed (True) or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    with self._condition:
      while (self._queue or self._busy) and self._error is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          return False
        self._condition.wait(remaining)
    return self._error is None

  def drain(self, timeout_s: float = EXIT_FLUSH_S) -> bool:
    """`flush` at a session's end, bounded in seconds, not in the clients' minutes:
    when writes are still queued, their storage is asked first (`storage.reachable`, 2
    s) and, when it does not answer, not waited for (nor at a later drain); else they
    are waited for up to `timeout_s`. True when every write landed."""
    done = self.flush(0)
    if done or timeout_s <= 0 or self._abandoned:
      return done
    if storage.reachable(self._pending_key()) is not None:
      self._abandoned = True
      return False
    return self.flush(timeout_s)

  def _pending_key(self) -> str:
    """The file (its URL) of the write in flight, else of the first one queued."""
    with self._condition:
      writing = self._writing
      return writing[0] if writing else next(iter(self._queue), "")

  def close(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """Writes what is queued (waiting at most `timeout_s`), then stops the thread. A
    thread still inside a write that has not landed is not joined: it waits for the
    storage's clients, and a session's end must not (it is a daemon)."""
    landed = self.flush(timeout_s)
    with self._condition:
      self._closed = True
      self._condition.notify_all()
    if landed:
      self._thread.join(timeout=1.0)

  def _next(self) -> Optional[tuple[str, Callable[[], None]]]:
    with self._condition:
      while not self._queue and not self._closed:
        self._condition.wait()
      if not self._queue:
        return None
      key = next(iter(self._queue))
      self._busy = True
      return key, self._queue.pop(key)

  def _run(self) -> None:
    while (job := self._next()) is not None:
      key, write = job
      while True:
        started = time.monotonic()
        self._writing = (key, started)
        try:
          write()
          self.outage.succeeded()
          break
        except UserError as error:
          self._writing = None
          try:
            backoff = self.outage.failed(error, key, started)
          except StorageOutageError as outage:
            with self._condition:
              self._error, self._busy = outage, False
              self._condition.notify_all()
            return
        retry_at = time.monotonic() + backoff
        with self._condition:
          while not self._closed and (remaining := retry_at - time.monotonic()) > 0:
            self._condition.wait(remaining)
          if self._closed:
            break
          write = self._queue.pop(key, write)  # a newer version of the file replaces it
      with self._condition:
        self._busy, self._writing = False, None
        self._condition.notify_all()
