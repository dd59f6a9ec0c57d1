"""The persistent checkpoint tier: Orbax checkpoints in `workdir/checkpoints`, on storage
every host shares (a local disk, NFS, a `gs://` or `s3://` bucket).

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
`complete_steps` ignores and `PersistentTier` deletes on start-up, so resume always picks
the newest *complete* step.

Every step carries a manifest of checksums (`pretrain.checkpoints.integrity`), written
before Orbax commits it and checked before it is read; a step that fails the check or
cannot be read raises `UnreadableCheckpointError` (the `Checkpointer` then sets it aside
as `<step>.corrupt-<kind>` and takes the next). A save that fails in the background is
reported by `poll`, `wait` and the next `save` as a `CheckpointSaveError`.

Besides the `CheckpointTier` protocol it has the optional capability of
`pretrain.checkpoints.tier` (its steps record the model: `check_newest_matches`) and
what the essential policy asks of a tier whose storage may go away (`unreachable`,
`saving`, `latest_step`).
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
# Orbax's default jax.Array handler is built with this store, and is registered in this
# registry; neither has a public alias.
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.serialization import type_handler_registry

from model.config import ModelConfig, describe_parametrization, recorded_parametrization
from plumbing import storage
from plumbing.errors import (CheckpointMismatchError, CheckpointSaveError,
                             UnreadableCheckpointError, UserError, warn)
from pretrain.checkpoints import integrity, orbax_manager
from pretrain.checkpoints.integrity import COMMIT_MARKER
from pretrain.checkpoints.tier import Restored, checked_read, ended_save_failure
from pretrain.run_directory import RunDirectory
from sharding.partition import path_str

T = TypeVar("T")


def _save_replicas_whole_on_cpu() -> None:
  """On one CPU process, saves write each replicated array whole instead of as
  per-replica slices.

  Orbax's replica-parallel save splits a replicated array into one slice per replica,
  a dispatched slice each, so that the copies from several accelerators to the host
  overlap and several processes share the writing. One CPU process has neither: its
  arrays are already in host memory and it writes every slice itself, so the slices only
  add dispatches, measured at 3 s of every save of the quickstart on 8 CPU devices (15 s
  of checkpoint time for 4 saves, 3 s without). Accelerators and multi-process runs keep
  Orbax's default (on two CPU processes, replica 0 of every shard would sit on process
  0, which would then write it all); the files are the same either way: only the writer
  of each slice changes (Orbax's default handler otherwise, with its array metadata
  store)."""
  if jax.default_backend() == "cpu" and jax.process_count() == 1:
    # `ocp.type_handlers.register_type_handler` would log a warning for the override
    # on stderr, which the project's commands keep to their own lines.
    type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY.add(
        jax.Array, ocp.type_handlers.ArrayHandler(
            use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()),
        override=True, ignore_warnings=True)


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


class PersistentTier:
  """Saves and restores training state in `run.checkpoints` with Orbax: the "persistent"
  `pretrain.checkpoints.tier.CheckpointTier`.

  Args:
    run: the run directory.
    keep_last, keep_every, async_save: `CheckpointConfig`'s fields of the same names.
    read_only: open existing checkpoints for reading (`pretrain.load`): nothing is
      created, cleaned up or saved.
  """
  name = "persistent"

  def __init__(self, run: RunDirectory, *, keep_last: int = 3,
               keep_every: Optional[int] = None, async_save: bool = True,
               read_only: bool = False):
    self.run = run
    self.directory = run.checkpoints
    self._async = async_save
    self._saving: Optional[int] = None    # the step of the async save in flight
    self._sealing: Optional[int] = None   # the step the manifest callback seals
    self._manager_failed = False   # closed after a failed save, with several processes
    self._reopen_pending = False   # closed after a failed save, to reopen at the next
    if not read_only and jax.process_index() == 0:
      # Orbax checks the commit marker only on gs:// paths; elsewhere a step directory
      # without it (non-atomic storage) would count as complete, so drop it here.
      for leftover in unmarked_step_dirs(self.directory):
        logging.warning("Removing incomplete checkpoint %s (interrupted save)", leftover)
        storage.rmtree(str(leftover))
    policies = [ocp.checkpoint_managers.LatestN(n=keep_last)]
    if keep_every:
      policies.append(ocp.checkpoint_managers.EveryNSteps(interval_steps=keep_every))
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=0 if read_only else 1,
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
        enable_async_checkpointing=async_save,
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
                       if async_save and not read_only else None))
    if read_only and not self.directory.exists():
      raise UserError(f"No checkpoints in {self.directory}: train first (python -m "
                      "pretrain.train ... --workdir=...) or convert one (pretrain.convert)")
    self._options = options
    self._manager = self._open_manager()

  def _open_manager(self, options: Optional[ocp.CheckpointManagerOptions] = None
                    ) -> ocp.CheckpointManager:
    _save_replicas_whole_on_cpu()
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
    not there: the run stops (`policies.Essential`) with the closed one."""
    try:
      with integrity.save_failures(step, str(self.directory)):
        if self._reopen_pending:
          self._manager = self._fresh_manager()
          self._reopen_pending = False
        yield
    except CheckpointSaveError as failure:
      integrity.close_failed(self._manager)
      if jax.process_count() == 1:
        self._reopen()
      else:
        self._manager_failed = True
      raise self._named(failure) from failure.__cause__

  def _fresh_manager(self) -> ocp.CheckpointManager:
    """A manager to replace one closed after a failed save (without Orbax's clean-up
    of temporary directories at start: it would race `discard_failed`, which deletes
    the failed save's)."""
    return self._open_manager(dataclasses.replace(self._options,
                                                  cleanup_tmp_directories=False))

  def _reopen(self) -> None:
    """A fresh manager after a failed save. Opening one lists the directory: a storage
    that refuses the listing too (the failure's own cause, often) leaves the reopening
    to the next save, whose failure it then is, rather than replace the failure being
    reported with the client's error."""
    try:
      self._manager = self._fresh_manager()
      self._reopen_pending = False
    except Exception as error:  # pylint: disable=broad-except  # storage errors of every kind
      if integrity.write_failure(error) is None:
        raise
      self._reopen_pending = True

  def _named(self, failure: CheckpointSaveError) -> CheckpointSaveError:
    """`failure`, reworded as the storage's refusal when it is one (HTTP 401, 403, 404:
    `storage.refusal`, which names what to fix) rather than as the client's error."""
    directory = str(self.directory)
    error = failure.__cause__ if storage.is_url(directory) else None
    while error is not None:
      if reason := storage.refusal(directory, error):
        return CheckpointSaveError(failure.step, reason, directory)
      error = error.__cause__ or error.__context__
    return failure

  # -- queries ---------------------------------------------------------------
  def all_steps(self) -> list[int]:
    """Complete steps, ascending (Orbax's list, filtered by the commit marker); a
    storage that fails the listing is a one-line UserError (`storage.guarded`)."""
    return storage.guarded(str(self.directory), lambda: [
        step for step in self._manager.all_steps()
        if _committed(self.directory / str(step))])

  def latest_step(self) -> Optional[int]:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def has_item(self, step: int, item: str) -> bool:
    return (self.directory / str(step) / item).exists()

  def step_dir(self, step: int) -> str:
    return str(self.directory / str(step))

  def describe(self, step: int) -> str:
    return f"checkpoint of step {step} in {self.run.root}"

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

  def check_parametrization_matches(self, step: int, config: ModelConfig) -> None:
    """Raises CheckpointMismatchError, one line, when `step` was trained under another
    parametrisation than `config`'s: the weights are the same shapes but mean another
    model, and the optimizer's per-parameter rates would change mid-run."""
    recorded = recorded_parametrization(self.metadata(step).get("model_config", {}))
    wanted = describe_parametrization(config.parametrization, config.mup_base_width)
    if recorded != wanted:
      raise CheckpointMismatchError(
          f"Checkpoint {self.directory / str(step)} was trained under the {recorded} "
          f"parametrization, but the configuration asks for {wanted}; set "
          "ModelConfig.parametrization and mup_base_width as the checkpoint was trained, "
          "or use a fresh --workdir (the checkpoint is kept as it is)")

  def check_newest_matches(self, abstract_params: Any, config: ModelConfig) -> None:
    """`check_params_match` and `check_parametrization_matches` on the newest checkpoint
    that can be read, before anything is written; unreadable ones are left to
    `restore_newest`, which sets them aside."""
    for step in reversed(self.all_steps()):
      try:
        self.check_params_match(step, abstract_params)
        self.check_parametrization_matches(step, config)
        return
      except UnreadableCheckpointError:
        continue
      except Exception as error:  # pylint: disable=broad-except
        if integrity.read_problem(error) is None:
          raise

  def _checked(self, step: int, items: Optional[tuple[str, ...]],
               read: Callable[[], T]) -> T:
    """`read()` of `step` once its `items` (None: all) pass the integrity check; the
    processes split the check of the shared directory (`tier.checked_read`)."""
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
    """The failure of the save in flight, once it has ended; None while it runs, when
    it succeeded or when there is none. Does not wait."""
    return ended_save_failure(self._saving, self._manager, self._finish)

  def _finish(self) -> None:
    step, self._saving = self._saving, None
    if step is not None:
      with self._reporting(step):
        self._manager.wait_until_finished()

  def discard_failed(self, step: int) -> None:
    """Deletes what the failed save of `step` left (Orbax's temporary directory), so
    that it takes no space and is not mistaken for a step. A storage that refuses or
    does not answer keeps them: they have no commit marker, so no step is taken from
    them, and the next start deletes them (the save's own failure is the line to
    report, not this one)."""
    if jax.process_index() == 0:
      with contextlib.suppress(UserError):
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

  def saving(self) -> bool:
    """Whether a save is still being written in the background."""
    return self._saving is not None and self._manager.is_saving_in_progress()

  def unreachable(self) -> Optional[str]:
    """Why the tier's storage does not answer now, in one line; None when it
    does (always for a local disk: `storage.reachable`)."""
    reason = storage.reachable(str(self.directory))
    if jax.process_count() > 1:   # every process saves, or none: agree
      down = multihost_utils.process_allgather(np.int32(reason is not None))
      if reason is None and int(np.max(down)):
        reason = f"the storage of {self.directory} does not answer another process"
    return reason

  def set_aside(self, error: UnreadableCheckpointError) -> None:
    """Renames the unreadable step to `<step>.corrupt-<kind>` (process 0, the others
    wait for it) and lists the steps anew."""
    if jax.process_index() == 0:
      integrity.set_aside(str(self.directory), error.step, error.kind)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("checkpoint set aside")
    self._manager.reload()

  def resuming_from(self, step: int) -> None:
    del step  # newer steps were unreadable, and are set aside already

  def wait(self) -> None:
    """Blocks until the save in flight has ended; raises CheckpointSaveError if it
    failed."""
    self._finish()

  def close(self) -> None:
    """Waits for the save in flight and closes. A save that failed now is reported in
    one line, not raised: the run is ending (it failed or was stopped) and nothing is
    left to retry it."""
    try:
      self._finish()
    except CheckpointSaveError as failure:
      warn(str(failure))
    if not self._manager_failed:
      self._manager.close()
