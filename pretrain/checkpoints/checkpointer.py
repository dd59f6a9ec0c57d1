"""Orbax checkpoints of a training run: async saves, a keep policy, safe resume.

A step directory `checkpoints/<step>/` holds four items:
  params        the model parameters (float32 masters), sharded arrays
  opt_state     the optimizer state (absent in a converted, step-0 checkpoint)
  train         JSON {"step", "rng"}: the step counter and the RNG key data
  metadata      JSON: the ModelConfig fields, the vocabulary ("byte" or a SentencePiece
                path) and the training sequence length, so `pretrain.load`, `evaluate`
                and `sample` need nothing but the checkpoint
The data position is not stored: the pipeline's batch at step s is a pure function of
(seed, s), so the step is enough to continue the exact stream.

Orbax writes each step into a temporary directory and renames it when every item is
complete, then writes `commit_success.txt`. A run killed mid-save leaves at most a
`<step>.orbax-checkpoint-tmp-*` directory (removed by Orbax's `cleanup_tmp_directories`)
or, on storage without atomic rename, a step directory without the marker, which
`complete_steps` ignores and `Checkpointer` deletes on start-up, so resume always picks
the newest *complete* step.

Every step of both tiers carries a manifest of checksums (`pretrain.checkpoints.integrity`), written
before Orbax commits it and checked before it is read. `restore_newest` skips a step that
fails the check or cannot be read (and sets it aside as `<step>.corrupt-<kind>`); a save
that fails in the background is reported by `poll`, `wait` and the next `save` as a
`CheckpointSaveError`.

`Checkpointer` is the persistent `pretrain.checkpoints.tier.CheckpointTier` and holds the
run's secondary tiers (`add_tier`). With `CheckpointConfig.local_dir` set, one is the
local tier (`pretrain.checkpoints.local`), saving every `local_every` steps to each host's
own disk; `restore_newest` takes the newest good step of any tier, a secondary one only
if every process holds it. A failed secondary save turns that tier off for the rest of
the run, with one line, and on every process (agreed at the tier's next save).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterator, Mapping, Optional, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from plumbing import storage
from plumbing.errors import (CheckpointMismatchError, CheckpointSaveError,
                             UnreadableCheckpointError, UserError, warn)
from pretrain.checkpoints import integrity, orbax_manager
from pretrain.checkpoints.tier import CheckpointTier, Restored, checked_read
from pretrain.checkpoints.integrity import COMMIT_MARKER
from pretrain.checkpoints.local import MAX_LOCAL_KEEP, LocalCheckpointer, process_directory
from pretrain.checkpoints.outage import Outage, StorageConfig
from sharding.partition import path_str

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """When to save and what to keep.

  Attributes:
    keep_last: keep the newest `keep_last` checkpoints.
    keep_every: additionally keep every checkpoint whose step is a multiple of this
      (long-term snapshots); None keeps only the newest ones.
    async_save: write in a background thread while training continues.
    local_dir: the local tier's directory on each host (a local SSD or `/dev/shm`);
      None: no local tier. Each run and process gets its own subdirectory.
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


def checkpoint_dir(workdir: str) -> epath.Path:
  """`workdir/checkpoints`, absolute: Orbax's tensorstore (OCDBT) layer rejects relative
  paths, and every command takes `--workdir` relative to the current directory (a
  `gs://` or `s3://` workdir is used as it is)."""
  return storage.as_path(storage.join(storage.resolve(workdir), "checkpoints"))


def _step_of(path: epath.Path) -> Optional[int]:
  return int(path.name) if path.name.isdigit() else None


def _committed(path: epath.Path) -> bool:
  return (path / COMMIT_MARKER).exists()


def complete_steps(directory: epath.PathLike) -> list[int]:
  """Steps under `directory` whose save finished (commit marker present), ascending."""
  directory = epath.Path(directory)
  if not directory.exists():
    return []
  return sorted(step for path in directory.iterdir()
                if (step := _step_of(path)) is not None and _committed(path))


def unmarked_step_dirs(directory: epath.PathLike) -> list[epath.Path]:
  """Step directories without the commit marker: saves cut short on non-atomic storage."""
  directory = epath.Path(directory)
  if not directory.exists():
    return []
  return sorted(path for path in directory.iterdir()
                if _step_of(path) is not None and not _committed(path))


def shapes_by_path(tree: Any) -> dict[str, tuple[int, ...]]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_str(path): tuple(leaf.shape) for path, leaf in leaves}


def describe_mismatch(saved: Mapping[str, tuple[int, ...]],
                      expected: Mapping[str, tuple[int, ...]],
                      limit: int = 12) -> Optional[str]:
  """A readable list of parameter differences, or None when the trees agree."""
  lines = []
  for path in sorted(set(saved) | set(expected)):
    if path not in saved:
      lines.append(f"  {path}: in the model {expected[path]}, missing from the checkpoint")
    elif path not in expected:
      lines.append(f"  {path}: in the checkpoint {saved[path]}, not in the model")
    elif saved[path] != expected[path]:
      lines.append(f"  {path}: checkpoint {saved[path]} vs model {expected[path]}")
  if not lines:
    return None
  more = len(lines) - limit
  shown = lines[:limit] + ([f"  ... and {more} more"] if more > 0 else [])
  return "\n".join(shown)


class Checkpointer:
  """Saves and restores training state under `workdir/checkpoints` with Orbax: the
  "persistent" CheckpointTier, which also drives the run's secondary tiers."""
  name = "persistent"

  def __init__(self, workdir: str, config: CheckpointConfig = CheckpointConfig(),
               read_only: bool = False, outage_s: float = StorageConfig.outage_s):
    self.directory = checkpoint_dir(workdir)
    # Since when saves to a bucket have failed for want of an answer (CheckpointHook).
    self.outage = Outage(outage_s)
    self._async = config.async_save
    self._saving: Optional[int] = None    # the step of the async save in flight
    self._sealing: Optional[int] = None   # the step the manifest callback seals
    self._manager_failed = False   # closed after a failed save, with several processes
    if not read_only and jax.process_index() == 0:
      # Orbax checks the commit marker only on gs:// paths; elsewhere a step directory
      # without it (non-atomic storage) would count as complete, so drop it here.
      for leftover in unmarked_step_dirs(self.directory):
        logging.warning("Removing incomplete checkpoint %s (interrupted save)", leftover)
        storage.rmtree(str(leftover))
    policies = [ocp.checkpoint_managers.LatestN(n=config.keep_last)]
    if config.keep_every:
      policies.append(ocp.checkpoint_managers.EveryNSteps(interval_steps=config.keep_every))
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=0 if read_only else 1,
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
        enable_async_checkpointing=config.async_save,
        create=not read_only,
        cleanup_tmp_directories=not read_only,
        read_only=read_only,
        # Orbax commits a step by renaming its temporary directory, except on gs://,
        # where it writes the step in place and commits it with the marker file. S3 has
        # no rename either (a copy per object that can fail half-way): commit there by
        # marker as well.
        temporary_path_class=(ocp.path.atomicity.CommitFileTemporaryPath
                              if str(self.directory).startswith("s3://") else None),
        # The manifest is written once every file is, before the commit (process 0).
        async_options=(ocp.AsyncOptions(post_finalization_callback=self._seal)
                       if config.async_save and not read_only else None))
    if read_only and not self.directory.exists():
      raise UserError(f"No checkpoints in {self.directory}: train first (python -m "
                      "pretrain.train ... --workdir=...) or convert one (pretrain.convert)")
    self._options = options
    self._manager = self._open_manager()
    self._secondary: list[tuple[CheckpointTier, int]] = []   # (tier, save interval)
    self._secondary_saved: dict[int, int] = {}   # id(tier) -> the step it last saved
    self._failed_here: set[int] = set()   # id(tier): off here, not yet everywhere (`_drop`)
    # This process's local tier directory (None without one); a bucket run also keeps
    # there what the bucket did not take when an outage stopped it (`MetricsWriter`).
    self.local_directory: Optional[epath.Path] = None
    if config.local_dir and not read_only:
      self.local_directory = process_directory(config.local_dir, workdir)
      self.add_tier(LocalCheckpointer(self.local_directory, config.local_keep,
                                      config.async_save),
                    every=config.local_every)

  def add_tier(self, tier: CheckpointTier, every: int) -> None:
    """Adds a secondary tier that saves every `every` steps (`save_secondary`) and is
    restored from when it holds the newest good step (`restore_newest`)."""
    if every < 1:
      raise ValueError(f"a checkpoint tier's interval must be >= 1, got {every}")
    self._secondary.append((tier, every))

  @property
  def tiers(self) -> list[CheckpointTier]:
    """Every tier in use: this (persistent) one first, then the secondary ones."""
    return [self] + [tier for tier, _ in self._secondary
                     if id(tier) not in self._failed_here]

  def secondary_intervals(self) -> list[int]:
    """The save intervals of the secondary tiers (`CheckpointHook` saves at them)."""
    return [every for _, every in self._secondary]

  def _open_manager(self, options: Optional[ocp.CheckpointManagerOptions] = None
                    ) -> ocp.CheckpointManager:
    handlers = dict(params=ocp.StandardCheckpointHandler(),
                    opt_state=ocp.StandardCheckpointHandler(),
                    train=ocp.JsonCheckpointHandler(),
                    metadata=ocp.JsonCheckpointHandler())
    return orbax_manager.CheckpointManager(self.directory,
                                           options=options or self._options,
                                           item_handlers=handlers)

  @contextlib.contextmanager
  def _reporting(self, step: int) -> Iterator[None]:
    """A failure of saving `step` inside the block becomes a CheckpointSaveError, and
    Orbax's manager, which holds copies of that failure to raise at later calls, is
    closed and replaced by a fresh one (which lists the steps on disk anew). With
    several processes a new manager would wait at a barrier for the others, which are
    not there: the run stops (CheckpointHook) with the closed one."""
    try:
      with integrity.save_failures(step, str(self.directory)):
        yield
    except CheckpointSaveError:
      integrity.close_failed(self._manager)
      if jax.process_count() == 1:
        # Without Orbax's clean-up of temporary directories at start: it would race
        # `discard_failed`, which deletes the failed save's.
        self._manager = self._open_manager(
            dataclasses.replace(self._options, cleanup_tmp_directories=False))
      else:
        self._manager_failed = True
      raise

  # -- queries ---------------------------------------------------------------
  def all_steps(self) -> list[int]:
    """Complete steps, ascending (Orbax's list, filtered by the commit marker)."""
    return [step for step in self._manager.all_steps()
            if _committed(self.directory / str(step))]

  def latest_step(self) -> Optional[int]:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def has_item(self, step: int, item: str) -> bool:
    return (self.directory / str(step) / item).exists()

  def step_dir(self, step: int) -> str:
    return str(self.directory / str(step))

  def describe(self, step: int) -> str:
    return f"checkpoint of step {step} in {self.directory.parent}"

  def restorable_steps(self, abstract_leaves: Any) -> list[int]:
    """Every complete step: the storage is shared, so every process sees the same."""
    del abstract_leaves  # resharded on restore
    return self.all_steps()

  def metadata(self, step: int) -> dict[str, Any]:
    """The step's JSON metadata (`pretrain.checkpoints.metadata.RunMetadata.to_json`); raises
    UnreadableCheckpointError when it fails its check or cannot be read."""
    def read():
      return self._manager.restore(
          step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))["metadata"]
    return dict(self._checked(step, ("metadata",), read))

  def check_params_match(self, step: int, abstract_params: Any) -> None:
    """Raises CheckpointMismatchError naming every parameter whose path or shape differs."""
    saved_tree = self._manager.item_metadata(step)["params"]
    saved_tree = getattr(saved_tree, "tree", saved_tree)
    problem = describe_mismatch(shapes_by_path(saved_tree), shapes_by_path(abstract_params))
    if problem:
      raise CheckpointMismatchError(
          f"Checkpoint {self.directory / str(step)} was written for a different model "
          f"configuration; these parameters differ:\n{problem}\nUse the Gin config the "
          "checkpoint was trained with, or a fresh --workdir.")

  def check_newest_matches(self, abstract_params: Any) -> None:
    """`check_params_match` on the newest checkpoint that can be read, before anything
    is written; unreadable ones are left to `restore_newest`, which sets them aside."""
    for step in reversed(self.all_steps()):
      try:
        self.check_params_match(step, abstract_params)
        return
      except Exception as error:  # pylint: disable=broad-except
        if integrity.read_problem(error) is None:
          raise

  def _checked(self, step: int, items: Optional[tuple[str, ...]],
               read: Callable[[], T]) -> T:
    """`read()` of `step` once its `items` (None: all) pass the integrity check; the
    processes split the check of the shared directory (`checkpoint_tier.checked_read`)."""
    return checked_read(step, self.name, self.step_dir(step), items,
                        (jax.process_index(), jax.process_count()), read)

  # -- save / restore ---------------------------------------------------------
  def _seal(self) -> None:
    integrity.seal(str(self.directory), self._sealing)

  def save(self, step: int, *, params: Any, opt_state: Any, rng: jax.Array,
           metadata: Mapping[str, Any]) -> None:
    """Starts an asynchronous save of `step` (returns once arrays are copied off
    device). Raises CheckpointSaveError when this save or the one before it failed."""
    self._finish()
    items = dict(
        params=ocp.args.StandardSave(params),
        train=ocp.args.JsonSave({"step": int(step),
                                 "rng": np.asarray(jax.random.key_data(rng)).tolist()}),
        metadata=ocp.args.JsonSave(dict(metadata)))
    if opt_state is not None:
      items["opt_state"] = ocp.args.StandardSave(opt_state)
    with self._reporting(step):
      self._sealing = step
      self._manager.save(step, args=ocp.args.Composite(**items), force=True)
      if self._async:
        self._saving = step
      elif jax.process_index() == 0:
        integrity.write_manifest(self.step_dir(step))

  def poll(self) -> Optional[CheckpointSaveError]:
    """The failure of the persistent save in flight, once it has ended; None while it
    runs, when it succeeded or when there is none. Does not wait. (A failed secondary
    save turns that tier off, with one line, and is not returned.)"""
    for tier in self.tiers[1:]:
      if (failure := tier.poll()) is not None:
        self._drop(tier, failure)
    if self._saving is None or self._manager.is_saving_in_progress():
      return None
    try:
      self._finish()
    except CheckpointSaveError as error:
      return error
    return None

  def _finish(self) -> None:
    step, self._saving = self._saving, None
    if step is not None:
      with self._reporting(step):
        self._manager.wait_until_finished()

  def discard_failed(self, step: int) -> None:
    """Deletes what the failed save of `step` left (Orbax's temporary directory), so
    that it takes no space and is not mistaken for a step."""
    if jax.process_index() == 0:
      integrity.remove_partial(str(self.directory), step)

  def restore(self, step: int, *, abstract_params: Any,
              abstract_opt_state: Any = None) -> Restored:
    """Restores `step` onto the shardings carried by the abstract trees (reshards).

    `opt_state` is None when the checkpoint has none or it was not asked for, `rng`
    when the checkpoint has none. Raises UnreadableCheckpointError when the items read
    fail their integrity check or cannot be read.
    """
    items = dict(params=ocp.args.StandardRestore(abstract_params))
    want_opt = abstract_opt_state is not None and self.has_item(step, "opt_state")
    if want_opt:
      items["opt_state"] = ocp.args.StandardRestore(abstract_opt_state)
    has_train = self.has_item(step, "train")
    if has_train:
      items["train"] = ocp.args.JsonRestore()

    def read():
      self.check_params_match(step, abstract_params)
      return self._manager.restore(step, args=ocp.args.Composite(**items))
    restored = self._checked(step, tuple(items), read)
    train = restored["train"] if has_train else {}
    return Restored(params=restored["params"],
                    opt_state=restored["opt_state"] if want_opt else None,
                    step=int(train["step"]) if has_train else step,
                    rng=(jax.random.wrap_key_data(np.asarray(train["rng"], np.uint32))
                         if has_train else None),
                    tier=self)

  # -- the secondary tiers -------------------------------------------------------
  def save_secondary(self, step: int, *, params: Any, opt_state: Any,
                     rng: jax.Array) -> None:
    """Saves `step` to each secondary tier whose interval divides it (none: no-op)."""
    for tier, every in list(self._secondary):
      if step % every == 0 and self._on_everywhere(tier):
        try:
          tier.save(step, params=params, opt_state=opt_state, rng=rng, metadata=None)
          self._secondary_saved[id(tier)] = step
        except CheckpointSaveError as failure:
          self._drop(tier, failure)

  def saving(self) -> bool:
    """Whether a persistent save is still being written in the background."""
    return self._saving is not None and self._manager.is_saving_in_progress()

  def unreachable(self) -> Optional[str]:
    """Why the persistent tier's storage does not answer now, in one line; None when it
    does (always for a local disk: `storage.reachable`)."""
    reason = storage.reachable(str(self.directory))
    if jax.process_count() > 1:   # every process saves, or none: agree
      down = multihost_utils.process_allgather(np.int32(reason is not None))
      if reason is None and int(np.max(down)):
        reason = f"the storage of {self.directory} does not answer another process"
    return reason

  def save_secondary_now(self, step: int, *, params: Any, opt_state: Any,
                         rng: jax.Array) -> list[str]:
    """Saves `step` to every secondary tier and waits for it: the last thing a run does
    before it stops because the persistent tier is unreachable. Returns where it is
    saved (one description per tier that holds it; empty without a secondary tier)."""
    saved = []
    for tier in self.tiers[1:]:
      try:
        tier.wait()
        if self._secondary_saved.get(id(tier)) != step:
          tier.save(step, params=params, opt_state=opt_state, rng=rng, metadata=None)
          tier.wait()
        saved.append(tier.describe(step))
      except CheckpointSaveError as failure:
        self._drop(tier, failure)
    return saved

  def _drop(self, tier: CheckpointTier, failure: CheckpointSaveError) -> None:
    """A secondary save failed: one line, the failed save's leftovers deleted, and no
    more saves to that tier this run (the persistent tier goes on; a restart uses the
    tier again). With several processes the others learn of it at the tier's next save
    (`_on_everywhere`) and stop there too."""
    warn(f"{failure}; the {tier.name} tier is off for the rest of this run")
    tier.discard_failed(failure.step)
    if jax.process_count() > 1:
      self._failed_here.add(id(tier))
    else:
      self._remove(tier)

  def _remove(self, tier: CheckpointTier) -> None:
    self._failed_here.discard(id(tier))
    self._secondary = [(t, every) for t, every in self._secondary if t is not tier]

  def _on_everywhere(self, tier: CheckpointTier) -> bool:
    """Whether every process still saves to `tier`; asked by all of them at each of its
    saves. A tier whose save failed on one process is turned off on all: each process
    keeps its own newest steps and a restart needs one they all hold, so processes that
    went on saving would prune the steps the failed one still has (a restart from
    scratch, in a chaos run). The outcome of each process's previous save is known
    first (Orbax would wait for it before the next save anyway)."""
    if jax.process_count() == 1:
      return True
    if id(tier) not in self._failed_here:
      try:
        tier.wait()
      except CheckpointSaveError as failure:
        self._drop(tier, failure)
    failed_here = id(tier) in self._failed_here
    if not int(np.max(multihost_utils.process_allgather(np.int32(failed_here)))):
      return True
    if not failed_here:
      warn(f"a {tier.name} checkpoint failed on another process; the {tier.name} tier is "
           "off on every process for the rest of this run (a restart needs a step every "
           "process holds)")
    self._remove(tier)
    return False

  def restore_newest(self, *, abstract_params: Any, abstract_opt_state: Any
                     ) -> tuple[Optional[Restored], list[UnreadableCheckpointError]]:
    """Restores the newest step of any tier that passes its integrity check and reads;
    (None, ...) when there is none.

    Also returns the steps skipped on the way, each set aside by its tier
    (`<step>.corrupt-<kind>`). A secondary tier offers only the steps every process
    holds; of two tiers holding the same step, the earlier in `tiers` (the persistent
    one first) is read. Every process takes the same step.
    """
    if jax.process_count() > 1:
      # The processes start the restore together, whatever the tiers: the collective
      # the local tier's agreement always ran here (with or without a local tier)
      # before the tiers were pluggable, kept so a run's collectives stay as they were.
      multihost_utils.sync_global_devices("restore newest checkpoint")
    leaves = jax.tree.leaves((abstract_params, abstract_opt_state))
    tiers = self.tiers
    # Newest step first; on a tie, the lower rank (the persistent tier's is 0) first.
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
    for tier in tiers:
      tier.resuming_from(restored.step if restored else 0)
    return restored, skipped

  def set_aside(self, error: UnreadableCheckpointError) -> None:
    """Renames the unreadable step to `<step>.corrupt-<kind>` (process 0, the others
    wait for it) and lists the steps anew."""
    if jax.process_index() == 0:
      integrity.set_aside(str(self.directory), error.step, error.kind)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("checkpoint set aside")
    self._manager.reload()

  def resuming_from(self, step: int) -> None:
    del step  # newer persistent steps were unreadable, and are set aside already

  def wait(self) -> None:
    """Blocks until the in-flight saves have ended. Raises CheckpointSaveError when the
    persistent one failed (a failed secondary one turns that tier off)."""
    for tier in self.tiers[1:]:
      try:
        tier.wait()
      except CheckpointSaveError as failure:
        self._drop(tier, failure)
    self._finish()

  def close(self) -> None:
    """Waits for the saves in flight and closes. A save that failed now is reported in
    one line, not raised: the run is ending (it failed or was stopped) and nothing is
    left to retry it."""
    if self.outage.ongoing:   # the storage does not answer: nothing left to wait for
      for tier in self.tiers[1:]:
        tier.close()
      return
    try:
      self.wait()
    except CheckpointSaveError as failure:
      warn(str(failure))
    if not self._manager_failed:
      self._manager.close()
    for tier in self.tiers[1:]:
      tier.close()
