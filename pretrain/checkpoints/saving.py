"""When the loop saves a checkpoint, and what it does when a save fails or the storage
does not answer: `CheckpointHook` (see its docstring).

It writes its lines through the run's metrics writer (`info`), which it takes as an
argument, so this wing does not import observability.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Optional, Protocol, Sequence

import jax

from plumbing.errors import CheckpointSaveError, UserError, warn
from pretrain.checkpoints.checkpointer import Checkpointer
from pretrain.hook_interface import Hook
from pretrain.steps import TrainState

SAVE_POLL_S = 0.2   # how often a save waiting for the one in flight asks the storage


class InfoWriter(Protocol):
  """Where the hook's lines go: the run's `MetricsWriter`."""

  def info(self, message: str) -> None:
    ...


class CheckpointHook(Hook):
  """Saves every `every` steps and at the end (once per step), asynchronously; also to
  the checkpointer's secondary tiers (the local one, ...) at the multiples of their
  intervals (`tier_every`) that are not persistent saves.

  A save that fails in the background is noticed at the next step boundary (the
  checkpointer is polled with every step's metrics): one line, then the failed save's
  leftovers are deleted and the current step is saved at once, waiting for it. If that
  fails too, the run stops (exit code 1) with the newest good
  checkpoint intact and no leftovers. With several processes the run stops at the
  first failure: a retry is a save every process must join, and the others are still
  waiting inside Orbax for the process whose save failed. A failed secondary save only
  turns that tier off (`Checkpointer.poll`).

  A bucket that does not answer (`Checkpointer.unreachable`, asked before each save and
  after a failed one) is an outage, not a failure: one line, the save is deferred and
  training goes on; at every later step whose backoff has passed (1, 2, 4, ... s, at
  most 30) the storage is asked again, and once it answers the current step is saved
  (and a failed save's leftovers deleted). After `StorageConfig.outage_s` of outage,
  `Outage.failed` raises StorageOutageError and the trainer stops after a save to the
  secondary tiers. The final save waits for the storage the same way.

  `persisted_step` is the step the run starts at when the persistent tier holds it (a
  fresh start's 0 too), None when it resumed from another tier: a run resumed from a
  local save of its last step (the bucket was down when it ended) trains no step and
  still owes the bucket that step's save.
  """
  goodput_category = "checkpoint"

  def __init__(self, checkpointer: Checkpointer, every: int, *, persisted_step: Optional[int],
               rng: jax.Array, metadata: Mapping[str, Any], writer: InfoWriter,
               tier_every: Sequence[int] = ()):
    self.every = every
    self._tier_every = tuple(tier_every)
    self._checkpointer = checkpointer
    self._rng = rng
    self._metadata = dict(metadata)
    self._writer = writer
    self._failure: Optional[CheckpointSaveError] = None
    self.last_saved = persisted_step
    self._down: Optional[str] = None    # why the storage does not answer, while it does not
    self._retry_at = 0.0
    self._discard_later: list[int] = []  # failed saves whose leftovers are in the bucket

  def _save(self, step: int, state: TrainState) -> None:
    self._checkpointer.save(step, params=state.params, opt_state=state.opt_state,
                            rng=self._rng, metadata=self._metadata)
    self.last_saved = step

  def _retry(self, failure: CheckpointSaveError, step: int, state: TrainState) -> None:
    """One line about `failure`, then `step` saved again after deleting the failed
    save's leftovers; stops the run if that fails too."""
    self._checkpointer.discard_failed(failure.step)
    if jax.process_count() > 1:
      raise UserError(f"{failure}; stopped (with several processes a save is not "
                      f"retried). {self._newest_good()}") from None
    warn(f"{failure}; retrying with step {step}")
    try:
      self._save(step, state)
      self._checkpointer.wait()
    except CheckpointSaveError as again:
      self._checkpointer.discard_failed(again.step)
      raise UserError(f"{again} (retried once); stopped. {self._newest_good()}") from None

  def _newest_good(self) -> str:
    good = self._checkpointer.latest_step()
    return (f"The newest good checkpoint, step {good}, is intact in "
            f"{self._checkpointer.directory}" if good is not None
            else "No checkpoint of this run was saved")

  def on_metrics(self, step: int, values: Mapping[str, float]) -> None:
    del step, values
    self._failure = self._failure or self._checkpointer.poll()

  def _tier_due(self, step: int) -> bool:
    return any(step % every == 0 for every in self._tier_every)

  def is_due(self, step: int) -> bool:
    return (step % self.every == 0 or self._failure is not None or self._down is not None
            or self._tier_due(step))

  def _storage_down(self, step: int) -> bool:
    """Whether the save of `step` must wait for the storage (see the class docstring):
    True while its backoff runs or the storage does not answer, False once it does
    (after an outage: one line, and the leftovers of saves it failed deleted)."""
    # With several processes the storage is asked at every step of an outage: asking
    # is a gather, and the processes' clocks would not agree on when a backoff ends.
    if (self._down is not None and jax.process_count() == 1
        and time.monotonic() < self._retry_at):
      return True
    reason = self._checkpointer.unreachable()
    outage = self._checkpointer.outage
    if reason is None:
      if self._down is not None:
        self._writer.info(f"The storage of {self._checkpointer.directory} answers again "
                          f"after {outage.down_s():.0f} s: saving step {step}")
        outage.succeeded()
        self._down = None
        for failed in self._discard_later:
          self._checkpointer.discard_failed(failed)
        self._discard_later = []
      return False
    backoff = outage.failed(UserError(reason), f"checkpoint {step}")  # raises when too long
    if self._down is None:
      warn(f"checkpoint {step} deferred: {reason}; training goes on and the save is "
           f"retried with backoff for up to {outage.outage_s:.0f} s "
           "(StorageConfig.outage_s)")
    self._down = reason
    self._retry_at = time.monotonic() + backoff
    return True

  def _failed(self, failure: CheckpointSaveError, step: int, state: TrainState) -> None:
    """A save failed: an outage when the storage no longer answers (deferred),
    otherwise retried once (`_retry`). With several processes only some may see the
    failure, so none asks (the question is a gather every process must join)."""
    if jax.process_count() == 1 and self._checkpointer.unreachable() is not None:
      self._discard_later.append(failure.step)
      self._storage_down(step)
    else:
      self._retry(failure, step, state)

  def _previous_save_ended(self, step: int) -> bool:
    """Waits for the save in flight, asking the storage meanwhile: False (the save of
    `step` deferred) when it stops answering, rather than wait for the storage's own
    retries. (With several processes every process must take the same decision at the
    same moment: they wait inside Orbax instead.)"""
    while jax.process_count() == 1 and self._checkpointer.saving():
      if self._storage_down(step):
        return False
      time.sleep(SAVE_POLL_S)
    return True

  def _attempt(self, step: int, state: TrainState, wait: bool
               ) -> Optional[CheckpointSaveError]:
    """Saves `step` unless it is saved already, and waits for it when `wait`; returns
    the failure of that save or of the one before it, if any. When the storage stops
    answering while the save before it is still being written, the save is deferred
    (`_storage_down`) instead."""
    if step != self.last_saved and not self._previous_save_ended(step):
      return None
    try:
      if step != self.last_saved:
        self._save(step, state)
      if wait:
        self._checkpointer.wait()
    except CheckpointSaveError as failure:
      return failure
    return None

  def on_step(self, step: int, state: TrainState) -> None:
    failure, self._failure = self._failure, None
    persistent = step % self.every == 0 or self._down is not None
    if failure is not None:
      self._failed(failure, step, state)   # a retry saves this step
    elif persistent and not self._storage_down(step):
      failure = self._attempt(step, state, wait=False)
      if failure is not None:
        self._failed(failure, step, state)
    elif self._tier_due(step):   # not at every step of an outage
      self._checkpointer.save_secondary(step, params=state.params,
                                        opt_state=state.opt_state, rng=self._rng)

  def on_end(self, step: int, state: TrainState, preempted: bool) -> None:
    failure, self._failure = self._failure, None
    while True:
      if failure is not None:
        self._failed(failure, step, state)
      while self._storage_down(step):  # the last save waits for the storage
        time.sleep(max(0.0, self._retry_at - time.monotonic()))
      failure = self._attempt(step, state, wait=True)
      if failure is None and self.last_saved == step:
        break
    if preempted:
      self._writer.info(f"Preempted: saved step {step} in {self._checkpointer.directory}; "
                        "run the same command again to resume.")
