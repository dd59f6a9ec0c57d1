"""The run's checkpoint tiers as peers: `Checkpointer` saves, restores and prunes any list
of `pretrain.checkpoints.tier.CheckpointTier`s the same way; `CheckpointConfig` (Gin)
and `Checkpointer.for_run`, which builds the tiers a run has from it.

A run has the persistent tier (`pretrain.checkpoints.persistent`, `workdir/checkpoints`)
and, with `CheckpointConfig.local_dir` set, the local tier (`pretrain.checkpoints.local`,
each host's own disk). The `Checkpointer` knows neither: it holds each tier with its
interval and its policy (`pretrain.checkpoints.policies`: `Essential`, whose failed
saves are retried and whose storage may be waited for; `BestEffort`, which a failed
save turns off), and

  saves     every tier whose interval divides the step; the best-effort tiers skip the
            steps an essential tier takes (a step is not saved twice), and the last
            step goes to the essential tiers (`save_final`);
  restores  the newest step of any tier that passes its integrity check and reads
            (`restore_newest`; each tier offers the steps every process can restore),
            and of two tiers holding the same step the earlier in the list is read;
            each unreadable step is set aside by its tier (`<step>.corrupt-<kind>`);
  prunes    through each tier's own keep policy, and `resuming_from`: a tier may drop
            the steps newer than the one the run resumes from.

A capability only some tiers have is asked of whichever tier declares it
(`pretrain.checkpoints.tier.ModelCheck`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import jax
from jax.experimental import multihost_utils

from model.config import ModelConfig
from plumbing.errors import UnreadableCheckpointError
from pretrain.checkpoints.local import MAX_LOCAL_KEEP, LocalTier
from pretrain.checkpoints.outage import StorageConfig
from pretrain.checkpoints.persistent import PersistentTier
from pretrain.checkpoints.policies import BestEffort, Essential, Snapshot
from pretrain.checkpoints.tier import CheckpointTier, ModelCheck, Restored
from pretrain.run_directory import RunDirectory

Policy = Union[Essential, BestEffort]


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """When to save and what to keep.

  Attributes:
    keep_last: keep the newest `keep_last` checkpoints.
    keep_every: additionally keep every checkpoint whose step is a multiple of this
      (long-term snapshots); None keeps only the newest ones.
    async_save: write in a background thread while training continues.
    local_dir: the local tier's directory on each host (a local SSD or `/dev/shm`);
      None: no local tier. Each run and process gets its own subdirectory (the run's
      `RunDirectory` is built with it and owns that layout).
    local_every: save to the local tier every this many steps (steps that are also
      persistent saves are not saved twice).
    local_keep: local checkpoints kept per process. 2: when a process dies in the middle
      of a save, the others' previous step is still one every process holds.
  """
  keep_last: int = 3
  keep_every: Optional[int] = None
  async_save: bool = True
  local_dir: Optional[str] = None
  local_every: int = 10
  local_keep: int = 2

  def __post_init__(self):
    if self.keep_last < 1:
      raise ValueError(f"CheckpointConfig.keep_last must be >= 1, got {self.keep_last}")
    if self.keep_every is not None and self.keep_every < 1:
      raise ValueError(f"CheckpointConfig.keep_every must be >= 1 or None, got "
                       f"{self.keep_every}")
    if self.local_every < 1:
      raise ValueError(f"CheckpointConfig.local_every must be >= 1, got {self.local_every}")
    if not 1 <= self.local_keep <= MAX_LOCAL_KEEP:
      raise ValueError(f"CheckpointConfig.local_keep must be in 1..{MAX_LOCAL_KEEP}, got "
                       f"{self.local_keep}")


class Checkpointer:
  """Saves, restores and prunes the run's checkpoint tiers, in the order added (the
  order also breaks ties on restore: the earlier tier's step is read).

  Tiers come in through `add_tier` (or `for_run`, the tiers of `CheckpointConfig`), or
  already wrapped in their policies (`policies`).
  """

  def __init__(self, policies: Sequence[Policy] = ()) -> None:
    self._policies: list[Policy] = list(policies)

  @classmethod
  def for_run(cls, run: RunDirectory, config: CheckpointConfig = CheckpointConfig(), *,
              every: int, outage_s: float = StorageConfig.outage_s) -> "Checkpointer":
    """The tiers of a training run in `run`: the persistent one, essential, every
    `every` steps (`TrainConfig.checkpoint_every`); the local one, best effort, every
    `config.local_every` steps in `run.local_tier` when the run directory has a local
    directory (`RunDirectory(workdir, config.local_dir)`). The one place a new tier is
    wired to a Gin setting."""
    checkpointer = cls()
    checkpointer.add_tier(PersistentTier(run, keep_last=config.keep_last,
                                         keep_every=config.keep_every,
                                         async_save=config.async_save),
                          every=every, essential=True, outage_s=outage_s)
    if run.local_tier is not None:
      checkpointer.add_tier(LocalTier(run.local_tier, config.local_keep, config.async_save),
                            every=config.local_every)
    return checkpointer

  def add_tier(self, tier: CheckpointTier, every: int, *, essential: bool = False,
               outage_s: float = StorageConfig.outage_s) -> None:
    """Adds `tier`, saved every `every` steps. Essential: its failed saves are retried
    and stop the run, its storage is waited for up to `outage_s` (it must have the
    members of `policies.StorageTier`); otherwise a failed save turns it off."""
    self._policies.append(Essential(tier, every, outage_s) if essential
                          else BestEffort(tier, every))

  @property
  def tiers(self) -> list[CheckpointTier]:
    """Every tier in use, in order (a best-effort tier whose save failed is not)."""
    return [policy.tier for policy in self._policies if policy.active]

  @property
  def _essential(self) -> list[Essential]:
    return [policy for policy in self._policies if isinstance(policy, Essential)]

  @property
  def _best_effort(self) -> list[BestEffort]:
    return [policy for policy in self._policies if isinstance(policy, BestEffort)]

  # -- restore ---------------------------------------------------------------------
  def check_newest_matches(self, abstract_params: Any, config: ModelConfig) -> None:
    """Raises CheckpointMismatchError, before anything is written, when a tier that
    records the model (`ModelCheck`) holds a newest step of another one: other
    parameters, or the same ones under another parametrisation."""
    for tier in self.tiers:
      if isinstance(tier, ModelCheck):
        tier.check_newest_matches(abstract_params, config)

  def restore_newest(self, *, abstract_params: Any, abstract_opt_state: Any
                     ) -> tuple[Optional[Restored], list[UnreadableCheckpointError]]:
    """Restores the newest step of any tier that passes its integrity check and reads;
    (None, ...) when there is none.

    Also returns the steps skipped on the way, each set aside by its tier
    (`<step>.corrupt-<kind>`). Of two tiers holding the same step, the earlier in
    `tiers` is read. Every process takes the same step.
    """
    if jax.process_count() > 1:
      # The processes start the restore together, whatever the tiers: the collective
      # the local tier's agreement always ran here (with or without a local tier)
      # before the tiers were pluggable, kept so a run's collectives stay as they were.
      multihost_utils.sync_global_devices("restore newest checkpoint")
    leaves = jax.tree.leaves((abstract_params, abstract_opt_state))
    tiers = self.tiers
    # Newest step first; on a tie, the lower rank (the earlier tier) first.
    candidates = sorted(((step, -rank) for rank, tier in enumerate(tiers)
                         for step in tier.restorable_steps(leaves)), reverse=True)
    restored, skipped = None, []
    for step, negative_rank in candidates:
      tier = tiers[-negative_rank]
      try:
        restored = tier.restore(step, abstract_params=abstract_params,
                                abstract_opt_state=abstract_opt_state)
        break
      except UnreadableCheckpointError as error:
        skipped.append(error)
        tier.set_aside(error)
    start = restored.step if restored else 0
    for tier in tiers:
      tier.resuming_from(start)
    for policy in self._policies:
      policy.started(start, restored.tier if restored else None)
    return restored, skipped

  # -- save --------------------------------------------------------------------------
  def poll(self) -> None:
    """Asks each tier for the failure of its save in flight, without waiting (the loop
    calls it with every step's metrics): an essential tier's is handled at its next
    save, a best-effort tier is turned off."""
    for policy in self._policies:
      policy.poll()

  def is_due(self, step: int) -> bool:
    """Whether any tier saves at `step` (its interval, a retry, a deferred save)."""
    return any(policy.is_due(step) for policy in self._policies)

  def save(self, step: int, snapshot: Snapshot, info: Callable[[str], None]) -> None:
    """Saves `step` to the tiers due at it (`info`: where the lines of an outage's end
    go, the run's metrics writer)."""
    taken = False
    for policy in self._essential:
      taken = policy.save(step, snapshot, info) or taken
    if not taken:
      for policy in self._best_effort:
        policy.save(step, snapshot)

  def save_final(self, step: int, snapshot: Snapshot, info: Callable[[str], None]) -> None:
    """Saves the run's last step to the essential tiers and waits for it."""
    for policy in self._essential:
      policy.save_final(step, snapshot, info)

  def save_best_effort_now(self, step: int, snapshot: Snapshot) -> list[str]:
    """Saves `step` to every best-effort tier and waits for it: the last thing a run
    does before it stops because an essential tier's storage has been unreachable too
    long. Returns where it is saved (one description per tier that holds it)."""
    return [where for policy in self._best_effort
            if (where := policy.save_now(step, snapshot)) is not None]

  # -- the run's end and its messages --------------------------------------------
  def newest_good(self) -> Optional[tuple[int, str]]:
    """The newest complete step of the essential tiers and where it is (the tier's
    directory), for the line of a run that stops; None when there is none."""
    found = [(step, str(policy.tier.directory)) for policy in self._essential
             if (step := policy.newest_good()) is not None]
    return max(found, default=None)

  def directories(self) -> str:
    """Where the essential tiers save (their directories), for the run's lines."""
    return ", ".join(str(policy.tier.directory) for policy in self._essential)

  def wait(self) -> None:
    """Blocks until every tier's save in flight has ended. Raises CheckpointSaveError
    when an essential tier's failed (a best-effort tier's turns that tier off)."""
    for policy in self._policies:
      policy.wait()

  def close(self) -> None:
    """Waits for the saves in flight and closes every tier (an essential tier whose
    storage does not answer is not waited for)."""
    for policy in self._policies:
      policy.close()
