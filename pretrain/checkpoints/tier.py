"""What a checkpoint tier is: the `CheckpointTier` protocol, and the capabilities a tier
may add.

A run keeps its state in tiers, peers to each other: the persistent one
(`pretrain.checkpoints.persistent.PersistentTier`, `workdir/checkpoints`, storage every
host shares, perhaps a bucket) and the local one (`pretrain.checkpoints.local.LocalTier`,
each host's own disk, saved more often). `pretrain.checkpoints.checkpointer.Checkpointer`
drives any list of them the same way: it saves each at its interval, takes the newest
good step of any on restore, and treats a failed save by the tier's policy
(`pretrain.checkpoints.policies`). The trainer and the goodput rows name a tier only by
its `name`, so a third tier (say, a copy held in a peer host's memory) is one class
implementing this protocol, handed to `Checkpointer.add_tier`.

Beyond the protocol a tier may declare a capability, a protocol of its own here, that
the `Checkpointer` asks for wherever a tier has it: `ModelCheck` (a checkpoint of
another model is an error before anything is written). A tier's Orbax manager comes
from `pretrain.checkpoints.orbax_manager`, which keeps Orbax away from the preemption
sync service (the trainer's `PreemptionHook` asks it alone).

Reading a step is checked (`pretrain.checkpoints.integrity`) and agreed by every process
(`checked_read`): a step is restored by all processes or by none.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence, TypeVar, runtime_checkable

import jax
import numpy as np
from jax.experimental import multihost_utils

from plumbing.errors import CheckpointSaveError, UnreadableCheckpointError
from pretrain.checkpoints import integrity

# What can be wrong with a step (`integrity.Problem.kind`), numbered for a gather.
PROBLEM_KINDS = ("size", "checksum", "missing", "manifest", "unreadable")
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Restored:
  """A step read back from a tier.

  Attributes:
    params: the parameters, laid out as the abstract tree asked for.
    opt_state: the optimizer state; None when the step has none (a converted
      checkpoint) or it was not asked for.
    step: the step counter.
    rng: the run's RNG key; None when the step has none.
    tier: the tier it came from.
  """
  params: Any
  opt_state: Any
  step: int
  rng: Optional[jax.Array]
  tier: "CheckpointTier"


@runtime_checkable
class CheckpointTier(Protocol):
  """One place a run's training state is saved to and restored from (`isinstance`
  checks that a class has every member).

  Attributes:
    name: names the tier in messages, `UnreadableCheckpointError.tier` and the
      `restart` rows of metrics.jsonl ("persistent", "local").
  """
  name: str

  def describe(self, step: int) -> str:
    """How a message names step `step` ("local checkpoint of step 6 in /dev/shm/...")."""

  def restorable_steps(self, abstract_leaves: Sequence[Any]) -> list[int]:
    """The steps every process can restore onto arrays laid out as `abstract_leaves`
    (the flattened params and optimizer state), ascending; the same on every process."""

  def restore(self, step: int, *, abstract_params: Any,
              abstract_opt_state: Any = None) -> Restored:
    """Reads `step` onto the abstract trees' shardings. Raises
    UnreadableCheckpointError, on every process, when it fails its check or a read."""

  def set_aside(self, error: UnreadableCheckpointError) -> None:
    """Moves the unreadable step of `error` out of the way (`<step>.corrupt-<kind>`)."""

  def resuming_from(self, step: int) -> None:
    """The run resumes from `step` (of whichever tier, 0 when fresh); a tier may drop
    the newer steps it holds, which the run will save again."""

  def save(self, step: int, *, params: Any, opt_state: Any, rng: jax.Array,
           metadata: Any) -> None:
    """Starts saving `step` (asynchronously where the tier can). Raises
    CheckpointSaveError when this save or the one before it failed."""

  def poll(self) -> Optional[CheckpointSaveError]:
    """The failure of the save in flight once it has ended, else None; never waits."""

  def wait(self) -> None:
    """Blocks until the save in flight has ended; raises CheckpointSaveError if it
    failed."""

  def discard_failed(self, step: int) -> None:
    """Deletes what the failed save of `step` left, so it is never taken for a step."""

  def close(self) -> None:
    """Waits for the save in flight and releases the tier."""


@runtime_checkable
class ModelCheck(Protocol):
  """A tier whose steps record the model they were written for."""

  def check_newest_matches(self, abstract_params: Any, config: Any) -> None:
    """Raises CheckpointMismatchError when the newest readable step was written for
    parameters other than `abstract_params` (paths or shapes), or under a
    parametrisation other than the ModelConfig `config`'s."""


def ended_save_failure(in_flight: Optional[int], manager: Any,
                       wait: Callable[[], None]) -> Optional[CheckpointSaveError]:
  """A tier's `poll` over an Orbax manager: the failure of the save of step `in_flight`
  once the manager has ended it (`wait`, which then returns at once, raises it); None
  while it runs, when it succeeded or when there is none. Does not block."""
  if in_flight is None or manager.is_saving_in_progress():
    return None
  try:
    wait()
  except CheckpointSaveError as error:
    return error
  return None


def agreed_problem(problem: Optional[integrity.Problem]) -> Optional[str]:
  """The kind of problem any process found with a step, the same on every process
  (a step is restored by all of them or by none); a gather when there are several."""
  code = PROBLEM_KINDS.index(problem.kind) + 1 if problem else 0
  if jax.process_count() > 1:
    code = int(np.max(multihost_utils.process_allgather(np.int32(code))))
  return PROBLEM_KINDS[code - 1] if code else None


def _raise_if_any(step: int, tier: str, problem: Optional[integrity.Problem]) -> None:
  kind = agreed_problem(problem)
  if kind is not None:
    raise UnreadableCheckpointError(step, tier, kind, problem.detail if problem else None)


def checked_read(step: int, tier: str, step_dir: str, items: Optional[tuple[str, ...]],
                 share: tuple[int, int], read: Callable[[], T]) -> T:
  """`read()` of step `step` of `tier` once its `items` (None: all) in `step_dir` pass
  the integrity check; raises UnreadableCheckpointError on every process when the check
  or the read fails on any. `share` = (index, count): this process checks every
  count-th file from index (a shared directory is checked by all processes together,
  a process's own by itself: (0, 1))."""
  _raise_if_any(step, tier, integrity.verify(step_dir, items, share))
  result, problem = None, None
  try:
    result = read()
  except Exception as error:  # pylint: disable=broad-except  # classified below
    problem = integrity.read_problem(error)
    if problem is None:
      raise
  _raise_if_any(step, tier, problem)
  return result
