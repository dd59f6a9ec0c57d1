"""Starts a cooldown fork from its stable run's checkpoint, then runs its training.

The library of `python -m launch.fork` (launch/fork.py, whose docstring is the
command's manual; its flags and main are there).
"""
from __future__ import annotations



from plumbing import storage
from plumbing.errors import usage_error
from pretrain.checkpoints.persistent import complete_steps
from pretrain.run_directory import RunDirectory

STAGING = "fork_seed.partial"


def seed(source: str, step: int, workdir: str) -> bool:
  """Copies the committed checkpoint `step` of the run in `source` into `workdir`'s
  checkpoints unless the fork already has one; returns whether it copied.

  The copy goes to a staging directory first and is moved into place whole, so an
  interrupted copy is redone rather than mistaken for a checkpoint.

  Raises:
    UserError (exit code 2): the source has no committed checkpoint `step`.
  """
  target = str(RunDirectory(workdir).checkpoints)
  if complete_steps(target):
    return False
  source_dir = str(RunDirectory(source).checkpoints)
  if step not in complete_steps(source_dir):
    raise usage_error(f"the stable run {source} has no committed checkpoint of step {step} "
                      "to fork from; finish it first (launch.sweep starts forks once their "
                      "stable run has finished)")
  origin = storage.join(source_dir, str(step))
  staging = storage.join(workdir, STAGING)
  if storage.exists(staging):
    storage.rmtree(staging)
  for name in storage.list_files(origin):
    storage.copy(storage.join(origin, name), storage.join(staging, name))
  storage.makedirs(target)
  storage.move_tree(staging, storage.join(target, str(step)))
  return True
