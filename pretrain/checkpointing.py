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

Every step of both tiers carries a manifest of checksums (`pretrain.integrity`), written
before Orbax commits it and checked before it is read. `restore_newest` skips a step that
fails the check or cannot be read (and sets it aside as `<step>.corrupt-<kind>`); a save
that fails in the background is reported by `poll`, `wait` and the next `save` as a
`CheckpointSaveError`.

With `CheckpointConfig.local_dir` set, a second, local tier (`pretrain.local_checkpoints`)
saves every `local_every` steps to each host's own disk; `restore_newest` takes the
newest good step of either tier, a local one only if every process holds it. A failed
local save turns the local tier off for the rest of the run, with one line.
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

from pretrain import integrity
from pretrain import storage
from pretrain.errors import (CheckpointMismatchError, CheckpointSaveError,
                             UnreadableCheckpointError, UserError, warn)
from pretrain.integrity import COMMIT_MARKER
from pretrain.outage import Outage, StorageConfig
from pretrain.local_checkpoints import LocalCheckpointer, process_directory
from sharding.partition import path_str

# Local steps each process reports when the processes agree on one (a fixed-size gather).
MAX_LOCAL_KEEP = 4
# What can be wrong with a step (`integrity.Problem.kind`), numbered for a gather.
PROBLEM_KINDS = ("size", "checksum", "missing", "manifest", "unreadable")
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


def common_steps(steps_per_process: list[list[int]]) -> list[int]:
  """The steps that every process lists, ascending."""
  common = set(steps_per_process[0])
  for steps in steps_per_process[1:]:
    common &= set(steps)
  return sorted(common)


def agreed_problem(problem: Optional[integrity.Problem]) -> Optional[str]:
  """The kind of problem any process found with a step, the same on every process
  (a step is restored by all of them or by none); a gather when there are several."""
  code = PROBLEM_KINDS.index(problem.kind) + 1 if problem else 0
  if jax.process_count() > 1:
    code = int(np.max(multihost_utils.process_allgather(np.int32(code))))
  return PROBLEM_KINDS[code - 1] if code else None


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
  """Saves and restores training state under `workdir/checkpoints` with Orbax."""

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
    self.local_every = config.local_every
    self.local: Optional[LocalCheckpointer] = None
    if config.local_dir and not read_only:
      self.local = LocalCheckpointer(process_directory(config.local_dir, workdir),
                                     config.local_keep, config.async_save)

  def _open_manager(self, options: Optional[ocp.CheckpointManagerOptions] = None
                    ) -> ocp.CheckpointManager:
    handlers = dict(params=ocp.StandardCheckpointHandler(),
                    opt_state=ocp.StandardCheckpointHandler(),
                    train=ocp.JsonCheckpointHandler(),
                    metadata=ocp.JsonCheckpointHandler())
    return ocp.CheckpointManager(self.directory, options=options or self._options,
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

  def reached_preemption(self, step: int) -> bool:
    """Whether every process agreed to stop at `step` (JAX's preemption sync, through
    Orbax); False on a single-process run, which has no sync service."""
    return self._manager.reached_preemption(step)

  def has_item(self, step: int, item: str) -> bool:
    return (self.directory / str(step) / item).exists()

  def step_dir(self, step: int) -> str:
    return str(self.directory / str(step))

  def metadata(self, step: int) -> dict[str, Any]:
    """The step's JSON metadata (`pretrain.metadata.RunMetadata.to_json`); raises
    UnreadableCheckpointError when it fails its check or cannot be read."""
    def read():
      return self._manager.restore(
          step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))["metadata"]
    return dict(self._checked(step, "persistent", ("metadata",), read))

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

  def _checked(self, step: int, tier: str, items: Optional[tuple[str, ...]],
               read: Callable[[], T]) -> T:
    """`read()` of a step of `tier` whose `items` (None: all) pass the integrity check;
    raises UnreadableCheckpointError on every process when the check or the read fails
    on any. Persistent steps are shared: the processes split the check."""
    if tier == "local":
      step_dir, share = self.local.step_dir(step), (0, 1)
    else:
      step_dir, share = self.step_dir(step), (jax.process_index(), jax.process_count())
    problem = integrity.verify(step_dir, items, share)
    self._raise_if_any(step, tier, problem)
    result = None
    try:
      result = read()
    except Exception as error:  # pylint: disable=broad-except  # classified below
      problem = integrity.read_problem(error)
      if problem is None:
        raise
    self._raise_if_any(step, tier, problem)
    return result

  @staticmethod
  def _raise_if_any(step: int, tier: str, problem: Optional[integrity.Problem]) -> None:
    kind = agreed_problem(problem)
    if kind is not None:
      raise UnreadableCheckpointError(step, tier, kind, problem.detail if problem else None)

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
    runs, when it succeeded or when there is none. Does not wait. (A failed local save
    turns the local tier off, with one line, and is not returned.)"""
    if self.local is not None and (failure := self.local.poll()) is not None:
      self._drop_local(failure)
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
              abstract_opt_state: Any = None) -> dict[str, Any]:
    """Restores `step` onto the shardings carried by the abstract trees (reshards).

    Returns a dict with `params`, `opt_state` (None when the checkpoint has none or it
    was not asked for), `step` and `rng` (None when absent). Raises
    UnreadableCheckpointError when the items read fail their integrity check or cannot
    be read.
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
    restored = self._checked(step, "persistent", tuple(items), read)
    train = restored["train"] if has_train else {}
    return dict(params=restored["params"],
                opt_state=restored["opt_state"] if want_opt else None,
                step=int(train["step"]) if has_train else step,
                rng=(jax.random.wrap_key_data(np.asarray(train["rng"], np.uint32))
                     if has_train else None))

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

  # -- the local tier -----------------------------------------------------------
  def save_local_now(self, step: int, *, params: Any, opt_state: Any,
                     rng: jax.Array) -> Optional[str]:
    """Saves `step` to the local tier and waits for it: the last thing a run does
    before it stops because the persistent tier is unreachable. Returns the local
    directory when saved, None without a local tier (or when the save failed)."""
    for _ in range(2):   # the save in flight, then this step's unless that was it
      if self.local is None:
        break
      try:
        self.local.wait()
      except CheckpointSaveError as failure:
        self._drop_local(failure)
        break
      if self.local.latest_step() == step:
        break
      self.save_local(step, params=params, opt_state=opt_state, rng=rng)
    return str(self.local.directory) if self.local is not None else None

  def save_local(self, step: int, *, params: Any, opt_state: Any, rng: jax.Array) -> None:
    """Saves this process's shards of `step` to the local tier (no-op without one)."""
    if self.local is not None:
      try:
        self.local.save(step, jax.tree.leaves((params, opt_state)), rng)
      except CheckpointSaveError as failure:
        self._drop_local(failure)

  def _drop_local(self, failure: CheckpointSaveError) -> None:
    """A local save failed: one line, the failed save's leftovers deleted, and no more
    local saves this run (the persistent tier goes on; a restart uses the tier again)."""
    warn(f"{failure}; the local tier is off for the rest of this run")
    self.local.discard()
    self.local = None

  def agreed_local_steps(self, abstract_leaves: list[Any]) -> list[int]:
    """The local steps every process can restore with the current layout, ascending.

    Hosts can disagree (a replaced host has an empty local disk, a crash cut one save
    short), so each process gathers every process's usable steps and all take the
    steps they have in common; [] when there are none (or no local tier).
    """
    steps = self.local.usable_steps(abstract_leaves) if self.local is not None else []
    if jax.process_count() == 1:
      return steps
    mine = np.full(MAX_LOCAL_KEEP, -1, np.int64)  # -1: no step
    recent = steps[-MAX_LOCAL_KEEP:]
    mine[:len(recent)] = recent
    everyone = np.asarray(multihost_utils.process_allgather(mine)).reshape(
        jax.process_count(), MAX_LOCAL_KEEP)
    return common_steps([[s for s in row.tolist() if s >= 0] for row in everyone])

  def restore_newest(self, *, abstract_params: Any, abstract_opt_state: Any
                     ) -> tuple[Optional[dict[str, Any]], list[UnreadableCheckpointError]]:
    """Restores the newest step of either tier that passes its integrity check and
    reads; (None, ...) when there is none.

    Returns `restore`'s dict plus `tier` ("local" or "persistent"), and the steps
    skipped on the way, each set aside as `<step>.corrupt-<kind>` (by process 0 for
    the persistent tier, by the process holding it for the local one). A local step
    is a candidate only when every process holds it; a persistent and a local step of
    the same number: the persistent one first. Every process takes the same step.
    """
    leaves, treedef = jax.tree.flatten((abstract_params, abstract_opt_state))
    candidates = sorted([(step, "persistent") for step in self.all_steps()] +
                        [(step, "local") for step in self.agreed_local_steps(leaves)],
                        key=lambda c: (c[0], c[1] == "persistent"), reverse=True)
    restored, skipped = None, []
    for step, tier in candidates:
      try:
        if tier == "persistent":
          restored = dict(self.restore(step, abstract_params=abstract_params,
                                       abstract_opt_state=abstract_opt_state),
                          tier=tier)
        else:
          arrays, rng = self._checked(step, tier, None,
                                      lambda: self.local.restore(step, leaves))
          params, opt_state = jax.tree.unflatten(treedef, arrays)
          restored = dict(params=params, opt_state=opt_state, step=step, rng=rng,
                          tier=tier)
        break
      except UnreadableCheckpointError as error:
        skipped.append(error)
        self._set_aside(error)
    if self.local is not None:
      self.local.delete_after(restored["step"] if restored else 0)
    return restored, skipped

  def _set_aside(self, error: UnreadableCheckpointError) -> None:
    if error.tier == "local":
      if error.detail is not None:  # this process's copy is the unreadable one
        self.local.set_aside(error.step, error.kind)
      return
    if jax.process_index() == 0:
      integrity.set_aside(str(self.directory), error.step, error.kind)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("checkpoint set aside")
    self._manager.reload()

  def wait(self) -> None:
    """Blocks until the in-flight saves have ended. Raises CheckpointSaveError when the
    persistent one failed (a failed local one turns the local tier off)."""
    if self.local is not None:
      try:
        self.local.wait()
      except CheckpointSaveError as failure:
        self._drop_local(failure)
    self._finish()

  def close(self) -> None:
    """Waits for the saves in flight and closes. A save that failed now is reported in
    one line, not raised: the run is ending (it failed or was stopped) and nothing is
    left to retry it."""
    if self.outage.ongoing:   # the storage does not answer: nothing left to wait for
      if self.local is not None:
        self.local.close()
      return
    try:
      self.wait()
    except CheckpointSaveError as failure:
      warn(str(failure))
    if not self._manager_failed:
      self._manager.close()
    if self.local is not None:
      self.local.close()
