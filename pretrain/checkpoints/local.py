"""The local checkpoint tier: frequent saves of each process's own shards to local disk.

The persistent tier (`pretrain.checkpoints.persistent.PersistentTier`, `workdir/checkpoints`)
is written every `checkpoint_every` steps to storage every host shares; a crash loses the
steps since. The local tier saves every `CheckpointConfig.local_every` steps to a
directory on the host itself (a local SSD, `/dev/shm`; `RunDirectory.local_tier`),
keeping only the newest one or two, so a crash whose host survives loses at most that
interval.

Why not Orbax's `experimental.emergency.CheckpointManager`: in the Orbax version this
project pins it uses its local directory only when the mesh has more than one replica
slice (it restores a lost slice's shards from a peer slice); on the common one-slice job
it ignores the local directory. So each process runs a standard Orbax
`CheckpointManager` of its own over its own directory (every process a primary host,
`active_processes` this process alone: no cross-host barrier, no shared storage), and
its array handler writes every shard the process holds, whatever its replica id (the
settings Orbax's emergency manager uses for its local tier); plus a JSON item with the
step, the RNG and the process's shard layout. Orbax's atomic finalize (temporary directory, rename, commit marker) means a
step is listed only once complete; a directory without the marker is deleted on start.
Each step carries an integrity manifest (`pretrain.checkpoints.integrity`), like the persistent
tier's. A save that fails (the local disk is full) is reported by `poll` or `wait` as a
`CheckpointSaveError`; the `Checkpointer` then stops using the tier (the best-effort
policy of `pretrain.checkpoints.policies`).

Restoring needs the same layout (same process count, mesh and shardings): a step whose
recorded layout differs from the current one is not offered. Every process must restore
the same step, so `restorable_steps` agrees on the steps all processes hold.
"""
from __future__ import annotations

import logging
import shutil
from typing import Any, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jax.experimental import multihost_utils

from plumbing.errors import CheckpointSaveError, UnreadableCheckpointError
from pretrain.checkpoints import integrity, orbax_manager
from pretrain.checkpoints.tier import Restored, checked_read, ended_save_failure
from pretrain.checkpoints.integrity import COMMIT_MARKER, TMP_SUFFIX

# Local steps each process reports when the processes agree on one (a fixed-size gather).
MAX_LOCAL_KEEP = 4


def _committed(path: epath.Path) -> bool:
  return (path / COMMIT_MARKER).exists()


def common_steps(steps_per_process: list[list[int]]) -> list[int]:
  """The steps that every process lists, ascending."""
  common = set(steps_per_process[0])
  for steps in steps_per_process[1:]:
    common &= set(steps)
  return sorted(common)


def _index_key(index: tuple, shape: Sequence[int]) -> list[list[int]]:
  """A shard's index (slices) as [[start, stop], ...] per dimension."""
  return [[0 if s.start is None else int(s.start), dim if s.stop is None else int(s.stop)]
          for s, dim in zip(index, shape)]


def _leaf_layout(shape: Sequence[int], dtype: Any, indices: Sequence[tuple]) -> dict:
  keys = []
  for index in indices:
    key = _index_key(index, shape)
    if key not in keys:
      keys.append(key)
  return {"shape": list(shape), "dtype": np.dtype(dtype).name, "shards": keys}


def expected_layout(abstract_leaves: Sequence[Any]) -> list[dict]:
  """This process's shard layout of arrays with these shapes and shardings."""
  layout = []
  for leaf in abstract_leaves:
    indices = leaf.sharding.addressable_devices_indices_map(leaf.shape).values()
    layout.append(_leaf_layout(leaf.shape, leaf.dtype, sorted(
        indices, key=lambda index: _index_key(index, leaf.shape))))
  return layout


class LocalTier:
  """Saves and restores this process's shards of the train state under `directory`: the
  "local" `pretrain.checkpoints.tier.CheckpointTier`."""
  name = "local"

  def __init__(self, directory: epath.Path, keep: int, async_save: bool = True):
    self.directory = directory
    self._async = async_save
    self._saving: Optional[int] = None    # the step of the async save in flight
    self._sealing: Optional[int] = None   # the step the manifest callback seals
    self.directory.mkdir(parents=True, exist_ok=True)
    for path in self.directory.iterdir():
      if (path.name.isdigit() and not _committed(path)) or TMP_SUFFIX in path.name:
        logging.warning("Removing incomplete local checkpoint %s (interrupted save)", path)
        shutil.rmtree(path, ignore_errors=True)
    # Every process is the primary host of its own directory and synchronises with no
    # other (the settings Orbax's emergency manager gives its local managers).
    me = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={me},
                                               barrier_sync_key_prefix=f"local{me}")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, save_interval_steps=1, enable_async_checkpointing=async_save,
        create=False, cleanup_tmp_directories=False, multiprocessing_options=alone,
        enable_per_process_directory_creation=True, save_root_metadata=False,
        enable_background_delete=False,
        # The manifest is written once every file is, before the commit.
        async_options=ocp.AsyncOptions(post_finalization_callback=self._seal)
        if async_save else None)
    # Arrays written by the process holding them, whatever their replica id (Orbax's
    # default writes replica 0 only, from the primary host).
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None,
                                                   use_replica_parallel=False)))
    handlers = dict(
        shards=ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True,
                                           multiprocessing_options=alone,
                                           type_handler_registry=registry),
        layout=ocp.JsonCheckpointHandler(multiprocessing_options=alone))
    self._manager = orbax_manager.CheckpointManager(self.directory, options=options,
                                                    item_handlers=handlers)

  def all_steps(self) -> list[int]:
    """Complete local steps, ascending."""
    return [step for step in self._manager.all_steps()
            if _committed(self.directory / str(step))]

  def _layout(self, step: int) -> dict:
    restored = self._manager.restore(
        step, args=ocp.args.Composite(layout=ocp.args.JsonRestore()))
    return dict(restored["layout"])

  def usable_steps(self, abstract_leaves: Sequence[Any]) -> list[int]:
    """Complete steps saved with the layout these abstract arrays have now."""
    expected = expected_layout(abstract_leaves)
    usable = []
    for step in self.all_steps():
      try:
        saved = self._layout(step)["leaves"]
      except (OSError, ValueError, KeyError) as error:
        logging.warning("Skipping unreadable local checkpoint %s: %s", step, error)
        continue
      if saved == expected:
        usable.append(step)
      else:
        logging.warning("Local checkpoint %d has another shard layout; not restoring it",
                        step)
    return usable

  def restorable_steps(self, abstract_leaves: Sequence[Any]) -> list[int]:
    """The steps every process can restore with the current layout, ascending.

    Hosts can disagree (a replaced host has an empty local disk, a crash cut one save
    short), so each process gathers every process's usable steps and all take the
    steps they have in common; [] when there are none.
    """
    steps = self.usable_steps(abstract_leaves)
    if jax.process_count() == 1:
      return steps
    mine = np.full(MAX_LOCAL_KEEP, -1, np.int64)  # -1: no step
    recent = steps[-MAX_LOCAL_KEEP:]
    mine[:len(recent)] = recent
    everyone = np.asarray(multihost_utils.process_allgather(mine)).reshape(
        jax.process_count(), MAX_LOCAL_KEEP)
    return common_steps([[s for s in row.tolist() if s >= 0] for row in everyone])

  def describe(self, step: int) -> str:
    return f"local checkpoint of step {step} in {self.directory}"

  def step_dir(self, step: int) -> str:
    return str(self.directory / str(step))

  def _seal(self) -> None:
    integrity.seal(str(self.directory), self._sealing)

  def save(self, step: int, *, params: Any, opt_state: Any, rng: jax.Array,
           metadata: Any = None) -> None:
    """Saves this process's shards of the params and optimizer state as step `step`
    (the metadata stays with the persistent tier); Orbax copies them to host memory
    before returning and writes in the background when async. Raises
    CheckpointSaveError for this save or the one before it."""
    del metadata
    leaves = jax.tree.leaves((params, opt_state))
    self.wait()
    layout = expected_layout(leaves)
    shards = {f"l{number:05d}": leaf for number, leaf in enumerate(leaves)}
    record = {"step": int(step), "leaves": layout,
              "rng": np.asarray(jax.random.key_data(rng)).tolist()}
    with integrity.save_failures(step, str(self.directory), local=True):
      self._sealing = step
      self._manager.save(step, args=ocp.args.Composite(
          shards=ocp.args.PyTreeSave(shards), layout=ocp.args.JsonSave(record)),
                         force=True)
      if self._async:
        self._saving = step
      else:
        integrity.write_manifest(self.step_dir(step))

  def poll(self) -> Optional[CheckpointSaveError]:
    """The failure of the save in flight, once it has ended; None while it runs, when
    it succeeded or when there is none. Does not wait."""
    return ended_save_failure(self._saving, self._manager, self.wait)

  def discard_failed(self, step: int) -> None:
    """Stops after the failed save of `step`: waits for nothing more and deletes the
    failed save's leftovers (the committed steps stay, for a restart on the same
    layout)."""
    integrity.close_failed(self._manager)
    for path in self.directory.iterdir():   # every leftover goes
      if TMP_SUFFIX in path.name or (path.name.isdigit() and not _committed(path)):
        shutil.rmtree(path, ignore_errors=True)
    # tensorstore may still complete the failed save's other writes, recreating what
    # was just deleted (seen: a `2.orbax-checkpoint-tmp` back after the deletion).
    integrity.remove_partial(str(self.directory), step)

  def set_aside(self, error: UnreadableCheckpointError) -> None:
    """Renames the unreadable step to `<step>.corrupt-<kind>` where this process's
    copy is the unreadable one (the process that found the problem has its detail)."""
    if error.detail is not None:
      integrity.set_aside(str(self.directory), error.step, error.kind)
      self._manager.reload()

  def restore(self, step: int, *, abstract_params: Any,
              abstract_opt_state: Any = None) -> Restored:
    """The params and optimizer state of `step`, checked first (every process agrees);
    this process reads only its own shards. Raises UnreadableCheckpointError."""
    leaves, treedef = jax.tree.flatten((abstract_params, abstract_opt_state))
    arrays, rng = checked_read(step, self.name, self.step_dir(step), None, (0, 1),
                               lambda: self._read(step, leaves))
    params, opt_state = jax.tree.unflatten(treedef, arrays)
    return Restored(params=params, opt_state=opt_state, step=step, rng=rng, tier=self)

  def _read(self, step: int, abstract_leaves: Sequence[Any]) -> tuple[list[jax.Array],
                                                                      jax.Array]:
    """The global arrays of `step` (laid out as `abstract_leaves`, which must match the
    saved layout: see `usable_steps`) and its RNG; each process reads only its own
    shards, from its own directory."""
    record = self._layout(step)
    restore_args = {f"l{number:05d}": ocp.ArrayRestoreArgs(sharding=leaf.sharding,
                                                           global_shape=leaf.shape,
                                                           dtype=leaf.dtype)
                    for number, leaf in enumerate(abstract_leaves)}
    shards = self._manager.restore(step, args=ocp.args.Composite(
        shards=ocp.args.PyTreeRestore(restore_args=restore_args)))["shards"]
    arrays = [shards[f"l{number:05d}"] for number in range(len(abstract_leaves))]
    rng = jax.random.wrap_key_data(np.asarray(record["rng"], np.uint32))
    return arrays, rng

  def resuming_from(self, step: int) -> None:
    """Deletes local steps newer than `step`, the step the run resumes from: a host
    may hold a step the others lack (one process died mid-save), and the run will save
    that step again."""
    for newer in [s for s in self._manager.all_steps() if s > step]:
      self._manager.delete(newer)

  def latest_step(self) -> Optional[int]:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def wait(self) -> None:
    """Blocks until the save in flight has ended; raises CheckpointSaveError if it
    failed."""
    step, self._saving = self._saving, None
    if step is not None:
      with integrity.save_failures(step, str(self.directory), local=True):
        self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
