"""What a tier's failed save means to the run: the two policies a `Checkpointer` drives a
tier by, each holding one tier and its save interval.

`Essential` (the persistent tier): the run's record, which the run cannot go on
without. A failed save is retried once and a second failure stops the run; a storage
that does not answer is an outage, not a failure: saves wait for it (with backoff) while
training goes on, for up to `StorageConfig.outage_s`.

`BestEffort` (the local tier): a faster, less durable copy. A failed save turns the tier
off for the rest of the run, on every process, with one line; the run goes on.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Optional, Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils

from plumbing.errors import CheckpointSaveError, CheckpointSaveStop, UserError, warn
from pretrain.checkpoints.outage import Outage
from pretrain.checkpoints.tier import CheckpointTier

SAVE_POLL_S = 0.2   # how often a save waiting for the one in flight asks the storage


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """What a save writes: the train state's arrays, the run's RNG and its metadata (the
  JSON item of `pretrain.checkpoints.metadata.RunMetadata`)."""
  params: Any
  opt_state: Any
  rng: jax.Array
  metadata: Mapping[str, Any]


class StorageTier(CheckpointTier, Protocol):
  """What `Essential` asks of its tier besides the protocol: a storage that may stop
  answering for a while (`pretrain.checkpoints.persistent.PersistentTier`)."""
  directory: Any

  def unreachable(self) -> Optional[str]:
    """Why the storage does not answer now, in one line (agreed by every process);
    None when it does."""

  def saving(self) -> bool:
    """Whether a save is still being written in the background."""

  def latest_step(self) -> Optional[int]:
    """The newest complete step (None when there is none)."""


def _every(every: int) -> int:
  if every < 1:
    raise ValueError(f"a checkpoint tier's interval must be >= 1, got {every}")
  return every


class Essential:
  """Saves `tier` every `every` steps and at the end (once per step), asynchronously.

  A save that fails in the background is noticed at the next step boundary (`poll`,
  with every step's metrics): one line, then the failed save's leftovers are deleted
  and the current step is saved at once, waiting for it. If that fails too, the run
  stops (exit code 1) with the newest good checkpoint intact and no leftovers. With
  several processes the run stops at the first failure: a retry is a save every
  process must join, and the others are still waiting inside Orbax for the process
  whose save failed.

  A storage that does not answer (`tier.unreachable`, asked before each save and after
  a failed one) is an outage: one line, the save is deferred and training goes on; at
  every later step whose backoff has passed (1, 2, 4, ... s, at most 30) the storage is
  asked again, and once it answers the current step is saved (and a failed save's
  leftovers deleted). After `outage_s` of outage, `Outage.failed` raises
  StorageOutageError and the trainer stops after a save to the best-effort tiers. The
  final save waits for the storage the same way.

  `last_saved` is the step the run started at when this tier holds it (a fresh start's
  0 too), None when it resumed from another tier (`started`): a run resumed from a
  local save of its last step (the bucket was down when it ended) trains no step and
  still owes this tier that step's save.
  """

  active = True   # an essential tier is never turned off

  def __init__(self, tier: StorageTier, every: int, outage_s: float,
               clock: Callable[[], float] = time.monotonic):
    self.tier = tier
    self.every = _every(every)
    # Since when saves have failed for want of an answer (`outage.Outage`).
    self.outage = Outage(outage_s, clock=clock)
    self.last_saved: Optional[int] = None
    self._failure: Optional[CheckpointSaveError] = None
    self._down: Optional[str] = None    # why the storage does not answer, while it does not
    self._retry_at = 0.0
    self._discard_later: list[int] = []  # failed saves whose leftovers are in the bucket

  def started(self, step: int, tier: Optional[CheckpointTier]) -> None:
    """The run starts at `step`, restored from `tier` (None: a fresh start)."""
    self.last_saved = step if tier in (None, self.tier) else None

  def poll(self) -> None:
    self._failure = self._failure or self.tier.poll()

  def is_due(self, step: int) -> bool:
    return step % self.every == 0 or self._failure is not None or self._down is not None

  def save(self, step: int, snapshot: Snapshot, info: Callable[[str], None]) -> bool:
    """Saves `step` when due (a failed save's retry, a deferred save, the interval);
    returns whether this tier took the step (saved it, retried with it, or deferred a
    failed save), so that the best-effort tiers leave it alone."""
    failure, self._failure = self._failure, None
    if failure is not None:
      self._failed(failure, step, snapshot, info)   # a retry saves this step
      return True
    if not (step % self.every == 0 or self._down is not None):
      return False
    if self._storage_down(step, info):
      return False
    failure = self._attempt(step, snapshot, info, wait=False)
    if failure is not None:
      self._failed(failure, step, snapshot, info)
    return True

  def save_final(self, step: int, snapshot: Snapshot, info: Callable[[str], None]) -> None:
    """Saves `step` (unless saved already) and waits for it; a pending failure is
    retried first and the storage waited for."""
    failure, self._failure = self._failure, None
    while True:
      if failure is not None:
        self._failed(failure, step, snapshot, info)
      while self._storage_down(step, info):  # the last save waits for the storage
        time.sleep(max(0.0, self._retry_at - time.monotonic()))
      failure = self._attempt(step, snapshot, info, wait=True)
      if failure is None and self.last_saved == step and self._down is None:
        break

  def newest_good(self) -> Optional[int]:
    return self.tier.latest_step()

  def wait(self) -> None:
    self.tier.wait()

  def close(self) -> None:
    if not self.outage.ongoing:   # the storage does not answer: nothing to wait for
      self.tier.close()

  def _save(self, step: int, snapshot: Snapshot) -> None:
    self.tier.save(step, params=snapshot.params, opt_state=snapshot.opt_state,
                   rng=snapshot.rng, metadata=snapshot.metadata)
    self.last_saved = step

  def _retry(self, failure: CheckpointSaveError, step: int, snapshot: Snapshot) -> None:
    """One line about `failure`, then `step` saved again after deleting the failed
    save's leftovers; stops the run if that fails too."""
    self.tier.discard_failed(failure.step)
    if jax.process_count() > 1:
      raise CheckpointSaveStop(f"{failure}; stopped (with several processes a save is "
                               f"not retried). {self._newest_good_line()}") from None
    warn(f"{failure}; retrying with step {step}")
    try:
      self._save(step, snapshot)
      self.tier.wait()
    except CheckpointSaveError as again:
      self.tier.discard_failed(again.step)
      raise CheckpointSaveStop(f"{again} (retried once); stopped. "
                               f"{self._newest_good_line()}") from None

  def _newest_good_line(self) -> str:
    try:
      good = self.newest_good()
    except UserError:   # the storage that failed the save refuses the listing too
      return f"The complete checkpoints in {self.tier.directory} are kept"
    return (f"The newest good checkpoint, step {good}, is intact in "
            f"{self.tier.directory}" if good is not None
            else "No checkpoint of this run was saved")

  def _storage_down(self, step: int, info: Callable[[str], None]) -> bool:
    """Whether the save of `step` must wait for the storage (see the class docstring):
    True while its backoff runs or the storage does not answer, False once it does
    (after an outage: one line, and the leftovers of saves it failed deleted)."""
    # With several processes the storage is asked at every step of an outage: asking
    # is a gather, and the processes' clocks would not agree on when a backoff ends.
    if (self._down is not None and jax.process_count() == 1
        and time.monotonic() < self._retry_at):
      return True
    reason = self.tier.unreachable()
    if reason is None:
      if self._down is not None:
        info(f"The storage of {self.tier.directory} answers again after "
             f"{self.outage.down_s():.0f} s: saving step {step}")
        self.outage.succeeded()
        self._down = None
        for failed in self._discard_later:
          self.tier.discard_failed(failed)
        self._discard_later = []
      return False
    backoff = self.outage.failed(UserError(reason), f"checkpoint {step}")  # raises when too long
    if self._down is None:
      warn(f"checkpoint {step} deferred: {reason}; training goes on and the save is "
           f"retried with backoff for up to {self.outage.outage_s:.0f} s "
           "(StorageConfig.outage_s)")
    self._down = reason
    self._retry_at = time.monotonic() + backoff
    return True

  def _failed(self, failure: CheckpointSaveError, step: int, snapshot: Snapshot,
              info: Callable[[str], None]) -> None:
    """A save failed: an outage when the storage no longer answers (deferred),
    otherwise retried once (`_retry`). With several processes only some may see the
    failure, so none asks (the question is a gather every process must join)."""
    if jax.process_count() == 1 and self.tier.unreachable() is not None:
      self._discard_later.append(failure.step)
      self._storage_down(step, info)
    else:
      self._retry(failure, step, snapshot)

  def _previous_save_ended(self, step: int, info: Callable[[str], None]) -> bool:
    """Waits for the save in flight, asking the storage meanwhile: False (the save of
    `step` deferred) when it stops answering, rather than wait for the storage's own
    retries. (With several processes every process must take the same decision at the
    same moment: they wait inside Orbax instead.)"""
    while jax.process_count() == 1 and self.tier.saving():
      if self._storage_down(step, info):
        return False
      time.sleep(SAVE_POLL_S)
    return True

  def _attempt(self, step: int, snapshot: Snapshot, info: Callable[[str], None],
               wait: bool) -> Optional[CheckpointSaveError]:
    """Saves `step` unless it is saved already, and waits for it when `wait`; returns
    the failure of that save or of the one before it, if any. When the storage stops
    answering while the save before it is still being written, the save is deferred
    (`_storage_down`) instead; and so is the wait for this one (the final save waits
    for a stalled storage as for an outage, up to `outage_s`, not for the clients'
    own timeouts)."""
    if step != self.last_saved and not self._previous_save_ended(step, info):
      return None
    try:
      if step != self.last_saved:
        self._save(step, snapshot)
      if wait and self._previous_save_ended(step, info):
        self.tier.wait()
    except CheckpointSaveError as failure:
      return failure
    return None


class BestEffort:
  """Saves `tier` every `every` steps that no essential tier takes; a failed save turns
  it off for the rest of the run, with one line, the failed save's leftovers deleted
  (a restart uses the tier again).

  With several processes a tier whose save failed on one process is turned off on all:
  each process keeps its own newest steps and a restart needs one they all hold, so
  processes that went on saving would prune the steps the failed one still has (a
  restart from scratch, in a chaos run). The others learn of it at the tier's next
  save (`_on_everywhere`, asked by every process at each of its saves).
  """

  def __init__(self, tier: CheckpointTier, every: int):
    self.tier = tier
    self.every = _every(every)
    self.last_saved: Optional[int] = None
    self._failed_here = False   # off here, not yet everywhere (`_drop`)
    self._off = False           # off on every process

  @property
  def active(self) -> bool:
    """Whether the tier is still saved to and restored from."""
    return not (self._off or self._failed_here)

  def started(self, step: int, tier: Optional[CheckpointTier]) -> None:
    del step, tier   # it saves at its interval, whatever the run started from

  def poll(self) -> None:
    if self.active and (failure := self.tier.poll()) is not None:
      self._drop(failure)

  def is_due(self, step: int) -> bool:
    return not self._off and step % self.every == 0

  def save(self, step: int, snapshot: Snapshot) -> None:
    """Saves `step` when the interval divides it (and the tier is on everywhere)."""
    if step % self.every == 0 and not self._off and self._on_everywhere():
      try:
        self._write(step, snapshot)
      except CheckpointSaveError as failure:
        self._drop(failure)

  def save_now(self, step: int, snapshot: Snapshot) -> Optional[str]:
    """Saves `step` unless saved already and waits for it; where it is saved (the
    tier's description), None when the save failed or the tier is off."""
    if not self.active:
      return None
    try:
      self.tier.wait()
      if self.last_saved != step:
        self._write(step, snapshot)
        self.tier.wait()
      return self.tier.describe(step)
    except CheckpointSaveError as failure:
      self._drop(failure)
      return None

  def wait(self) -> None:
    """Waits for the save in flight; a failure turns the tier off."""
    if self.active:
      try:
        self.tier.wait()
      except CheckpointSaveError as failure:
        self._drop(failure)

  def close(self) -> None:
    self.wait()
    if self.active:
      self.tier.close()

  def _write(self, step: int, snapshot: Snapshot) -> None:
    self.tier.save(step, params=snapshot.params, opt_state=snapshot.opt_state,
                   rng=snapshot.rng, metadata=None)
    self.last_saved = step

  def _drop(self, failure: CheckpointSaveError) -> None:
    warn(f"{failure}; the {self.tier.name} tier is off for the rest of this run")
    self.tier.discard_failed(failure.step)
    if jax.process_count() > 1:
      self._failed_here = True
    else:
      self._off = True

  def _on_everywhere(self) -> bool:
    """Whether every process still saves to the tier; asked by all of them at each of
    its saves. The outcome of each process's previous save is known first (Orbax would
    wait for it before the next save anyway)."""
    if jax.process_count() == 1:
      return True
    if not self._failed_here:
      try:
        self.tier.wait()
      except CheckpointSaveError as failure:
        self._drop(failure)
    if not int(np.max(multihost_utils.process_allgather(np.int32(self._failed_here)))):
      return True
    if not self._failed_here:
      warn(f"a {self.tier.name} checkpoint failed on another process; the "
           f"{self.tier.name} tier is off on every process for the rest of this run (a "
           "restart needs a step every process holds)")
    self._failed_here, self._off = False, True
    return False
