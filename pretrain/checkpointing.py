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

With `CheckpointConfig.local_dir` set, a second, local tier (`pretrain.local_checkpoints`)
saves every `local_every` steps to each host's own disk; `restore_newest` takes the
newest complete step of either tier, the local one only if every process holds it.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from pretrain import storage
from pretrain.errors import CheckpointMismatchError, UserError
from pretrain.local_checkpoints import LocalCheckpointer, process_directory
from sharding.partition import path_str

COMMIT_MARKER = "commit_success.txt"
# Local steps each process reports when the processes agree on one (a fixed-size gather).
MAX_LOCAL_KEEP = 4


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


def newest_common_step(steps_per_process: list[list[int]]) -> Optional[int]:
  """The newest step that every process lists; None when they share none."""
  common = set(steps_per_process[0])
  for steps in steps_per_process[1:]:
    common &= set(steps)
  return max(common) if common else None


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
               read_only: bool = False):
    self.directory = checkpoint_dir(workdir)
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
                              if str(self.directory).startswith("s3://") else None))
    if read_only and not self.directory.exists():
      raise UserError(f"No checkpoints in {self.directory}: train first (python -m "
                      "pretrain.train ... --workdir=...) or convert one (pretrain.convert)")
    handlers = dict(params=ocp.StandardCheckpointHandler(),
                    opt_state=ocp.StandardCheckpointHandler(),
                    train=ocp.JsonCheckpointHandler(),
                    metadata=ocp.JsonCheckpointHandler())
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_handlers=handlers)
    self.local_every = config.local_every
    self.local: Optional[LocalCheckpointer] = None
    if config.local_dir and not read_only:
      self.local = LocalCheckpointer(process_directory(config.local_dir, workdir),
                                     config.local_keep, config.async_save)

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

  def metadata(self, step: int) -> dict[str, Any]:
    """The step's JSON metadata (`pretrain.metadata.RunMetadata.to_json`)."""
    restored = self._manager.restore(
        step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))
    return dict(restored["metadata"])

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

  # -- save / restore ---------------------------------------------------------
  def save(self, step: int, *, params: Any, opt_state: Any, rng: jax.Array,
           metadata: Mapping[str, Any]) -> None:
    """Starts an asynchronous save of `step` (returns once arrays are copied off device)."""
    items = dict(
        params=ocp.args.StandardSave(params),
        train=ocp.args.JsonSave({"step": int(step),
                                 "rng": np.asarray(jax.random.key_data(rng)).tolist()}),
        metadata=ocp.args.JsonSave(dict(metadata)))
    if opt_state is not None:
      items["opt_state"] = ocp.args.StandardSave(opt_state)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, step: int, *, abstract_params: Any,
              abstract_opt_state: Any = None) -> dict[str, Any]:
    """Restores `step` onto the shardings carried by the abstract trees (reshards).

    Returns a dict with `params`, `opt_state` (None when the checkpoint has none or it
    was not asked for), `step` and `rng` (None when absent).
    """
    self.check_params_match(step, abstract_params)
    items = dict(params=ocp.args.StandardRestore(abstract_params))
    want_opt = abstract_opt_state is not None and self.has_item(step, "opt_state")
    if want_opt:
      items["opt_state"] = ocp.args.StandardRestore(abstract_opt_state)
    has_train = self.has_item(step, "train")
    if has_train:
      items["train"] = ocp.args.JsonRestore()
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    train = restored["train"] if has_train else {}
    return dict(params=restored["params"],
                opt_state=restored["opt_state"] if want_opt else None,
                step=int(train["step"]) if has_train else step,
                rng=(jax.random.wrap_key_data(np.asarray(train["rng"], np.uint32))
                     if has_train else None))

  # -- the local tier -----------------------------------------------------------
  def save_local(self, step: int, *, params: Any, opt_state: Any, rng: jax.Array) -> None:
    """Saves this process's shards of `step` to the local tier (no-op without one)."""
    if self.local is not None:
      self.local.save(step, jax.tree.leaves((params, opt_state)), rng)

  def agreed_local_step(self, abstract_leaves: list[Any]) -> Optional[int]:
    """The newest local step every process can restore with the current layout.

    Hosts can disagree (a replaced host has an empty local disk, a crash cut one save
    short), so each process gathers every process's usable steps and all take the
    newest step they have in common; None when there is none (or no local tier).
    """
    steps = self.local.usable_steps(abstract_leaves) if self.local is not None else []
    if jax.process_count() == 1:
      return newest_common_step([steps])
    mine = np.full(MAX_LOCAL_KEEP, -1, np.int64)  # -1: no step
    recent = steps[-MAX_LOCAL_KEEP:]
    mine[:len(recent)] = recent
    everyone = np.asarray(multihost_utils.process_allgather(mine)).reshape(
        jax.process_count(), MAX_LOCAL_KEEP)
    return newest_common_step([[s for s in row.tolist() if s >= 0] for row in everyone])

  def restore_newest(self, *, abstract_params: Any,
                     abstract_opt_state: Any) -> Optional[dict[str, Any]]:
    """Restores the newest complete step of either tier; None when there is none.

    Returns `restore`'s dict plus `tier` ("local" or "persistent"). A local step wins
    only when it is newer than the newest persistent one and every process holds it.
    """
    abstract = (abstract_params, abstract_opt_state)
    leaves, treedef = jax.tree.flatten(abstract)
    local_step = self.agreed_local_step(leaves)
    persistent_step = self.latest_step()
    if local_step is not None and (persistent_step is None or local_step > persistent_step):
      arrays, rng = self.local.restore(local_step, leaves)
      params, opt_state = jax.tree.unflatten(treedef, arrays)
      restored = dict(params=params, opt_state=opt_state, step=local_step, rng=rng,
                      tier="local")
    elif persistent_step is not None:
      restored = dict(self.restore(persistent_step, abstract_params=abstract_params,
                                   abstract_opt_state=abstract_opt_state),
                      tier="persistent")
    else:
      restored = None
    if self.local is not None:
      self.local.delete_after(restored["step"] if restored else 0)
    return restored

  def wait(self) -> None:
    """Blocks until the in-flight saves (if any) are committed."""
    self._manager.wait_until_finished()
    if self.local is not None:
      self.local.wait()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
    if self.local is not None:
      self.local.close()
