"""When the loop saves a checkpoint: `CheckpointHook`, the loop's side of the
`Checkpointer` (which tiers save a step, and what a failed save or an unreachable
storage means, are the Checkpointer's and its policies', `pretrain.checkpoints.policies`).

It writes its lines through the run's metrics writer (`info`), which it takes as an
argument, so this wing does not import observability.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol

import jax

from pretrain.checkpoints.checkpointer import Checkpointer
from pretrain.checkpoints.policies import Snapshot
from pretrain.hook_interface import Hook
from pretrain.steps import TrainState


class InfoWriter(Protocol):
  """Where the hook's lines go: the run's `MetricsWriter`."""

  def info(self, message: str) -> None:
    ...


class CheckpointHook(Hook):
  """Saves to each tier of `checkpointer` when it is due and, at the end, the last step
  to the essential tiers, waiting for it. The checkpointer is polled with every step's
  metrics, so a save that failed in the background is noticed at the next step
  boundary."""
  goodput_category = "checkpoint"

  def __init__(self, checkpointer: Checkpointer, *, rng: jax.Array,
               metadata: Mapping[str, Any], writer: InfoWriter):
    self._checkpointer = checkpointer
    self._rng = rng
    self._metadata = dict(metadata)
    self._writer = writer

  def _snapshot(self, state: TrainState) -> Snapshot:
    return Snapshot(state.params, state.opt_state, self._rng, self._metadata)

  def on_metrics(self, step: int, values: Mapping[str, float]) -> None:
    del step, values
    self._checkpointer.poll()

  def is_due(self, step: int) -> bool:
    return self._checkpointer.is_due(step)

  def on_step(self, step: int, state: TrainState) -> None:
    self._checkpointer.save(step, self._snapshot(state), self._writer.info)

  def on_end(self, step: int, state: TrainState, preempted: bool) -> None:
    self._checkpointer.save_final(step, self._snapshot(state), self._writer.info)
    if preempted:
      self._writer.info(f"Preempted: saved step {step} in "
                        f"{self._checkpointer.directories()}; run the same command "
                        "again to resume.")
