"""What the training loop hands its hooks: the `Hook` base class, and the `StepInfo`
record a plain function hook (`StepCallback`) is called with.

The loop's own hooks are in `pretrain.hooks` (and the checkpoint saves in
`pretrain.checkpoints.saving`); the docstring of `pretrain.hooks` says when the loop calls
each method. This module sits at the bottom of `pretrain`, beside `steps`, so that any
wing may define a hook without importing the trainer.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol

from pretrain.steps import TrainState


class Hook:
  """Does nothing; subclasses override what they need.

  Attributes:
    every: `on_step` runs at steps that are multiples of this; 0 never.
    drains_metrics: whether earlier steps' metrics must be checked before `on_step`.
    stop_requested: set to ask the loop to stop after the current step.
    goodput_category: where the loop books the time of `on_step` and `on_end`
      (`pretrain.observability.goodput`).
  """
  every: int = 0
  drains_metrics: bool = True
  stop_requested: bool = False
  goodput_category: str = "other"

  def is_due(self, step: int) -> bool:
    return bool(self.every) and step % self.every == 0

  def on_metrics(self, step: int, values: Mapping[str, float]) -> None:
    del step, values

  def on_step(self, step: int, state: TrainState) -> None:
    del step, state

  def resumed(self, step: int) -> None:
    del step

  def on_end(self, step: int, state: TrainState, preempted: bool) -> None:
    del step, state, preempted

  def close(self) -> None:
    pass

  def results(self) -> Mapping[str, Any]:
    """What the hook adds to the run's result (`RunResult.results`); {} by default."""
    return {}


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """One finished step, as a `CallbackHook`'s function sees it.

  Attributes:
    step: optimizer steps done.
    state: the train state after the step (on the devices).
    metrics: the step's metrics on the host (`loss`, `learning_rate`, `grad_norm`,
      `param_norm`, ...; pretrain.steps).
  """
  step: int
  state: TrainState
  metrics: Mapping[str, float]


class StepCallback(Protocol):
  """A function hook: called with each due step's record."""

  def __call__(self, info: StepInfo) -> None:
    ...
