"""The trainer's seams, in process: hooks added on top of the defaults (functions of a
`StepInfo`, hooks reporting results), and a third checkpoint tier that is one class
written here alone (an in-memory copy, the shape of a peer-replicated tier): saved to
when due, resumed from exactly when it holds the newest good step, an unreadable step
of it set aside."""
import json
import os
import shutil

import jax
import numpy as np
import pytest

from plumbing.errors import UnreadableCheckpointError
from pretrain import hooks as hooks_lib
from pretrain.checkpoints.tier import CheckpointTier, Restored
from pretrain.checkpoints.checkpointer import CheckpointConfig, Checkpointer
from pretrain.checkpoints.persistent import complete_steps
from pretrain.run_directory import RunDirectory
from inprocess_trainer import TINY_MODEL, make_trainer

MODEL = TINY_MODEL


class InMemoryTier:
  """A checkpoint tier holding host copies of each saved step in a dict that outlives
  the trainer (standing in for a peer host's memory)."""
  name = "memory"

  def __init__(self, store: dict):
    self.store = store
    self.saved: list[int] = []

  def describe(self, step):
    return f"in-memory checkpoint of step {step}"

  def restorable_steps(self, abstract_leaves):
    del abstract_leaves
    return sorted(self.store)

  def restore(self, step, *, abstract_params, abstract_opt_state=None):
    host_params, host_opt, rng_data = self.store[step]
    if host_params is None:
      raise UnreadableCheckpointError(step, self.name, "missing", "dropped")
    params = jax.device_put(host_params, jax.tree.map(lambda a: a.sharding,
                                                      abstract_params))
    opt_state = jax.device_put(host_opt, jax.tree.map(lambda a: a.sharding,
                                                      abstract_opt_state))
    return Restored(params, opt_state, step, jax.random.wrap_key_data(rng_data), self)

  def set_aside(self, error):
    del self.store[error.step]

  def resuming_from(self, step):
    for newer in [s for s in self.store if s > step]:
      del self.store[newer]

  def save(self, step, *, params, opt_state, rng, metadata):
    del metadata
    self.store[step] = (jax.device_get(params), jax.device_get(opt_state),
                        np.asarray(jax.random.key_data(rng)))
    self.saved.append(step)

  def poll(self):
    return None

  def wait(self):
    pass

  def discard_failed(self, step):
    self.store.pop(step, None)

  def close(self):
    pass


class _Crash(Exception):
  pass


class _Reporter(hooks_lib.Hook):
  """A hook of a kind the trainer does not know, reporting a result."""

  def __init__(self):
    self.ended_at = None

  def on_end(self, step, state, preempted):
    self.ended_at = step

  def results(self):
    return {"reporter_end": self.ended_at}


def _train_losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  return {row["step"]: row["loss"] for row in rows if "loss" in row and "kind" not in row}


def _run(workdir, steps, store=None, crash_at=None, every=None):
  trainer, checkpointer, writer = make_trainer(str(workdir), MODEL, train_steps=steps,
                                               checkpoint_every=4)
  tier = None
  if store is not None:
    tier = InMemoryTier(store)
    checkpointer.add_tier(tier, every=1)
  infos = []
  trainer.add_hook(infos.append, every=every)
  if crash_at is not None:
    def crash(info):
      if info.step == crash_at:
        raise _Crash
    trainer.add_hook(crash)
  reporter = trainer.add_hook(_Reporter())
  try:
    result = trainer.run()
  except _Crash:
    result = None
  finally:
    checkpointer.close()
    writer.close()
  return result, infos, tier, reporter


@pytest.mark.slow   # three short in-process runs (CI runs it)
def test_a_third_tier_is_one_class_and_a_restart_resumes_from_it(tmp_path):
  reference, infos, _, reporter = _run(tmp_path / "reference", 6, every=2)
  # Added hooks run on top of the defaults: functions get one StepInfo per due step,
  # with that step's metrics; hooks of any kind report into the result.
  losses = _train_losses(tmp_path / "reference")
  assert [info.step for info in infos] == [2, 4, 6]
  assert [info.metrics["loss"] for info in infos] == [losses[2], losses[4], losses[6]]
  assert reference.results["train_loss"] == losses[6]
  assert reporter.ended_at == 6 and reference.results["reporter_end"] == 6

  store = {}
  workdir = tmp_path / "run"
  crashed, _, tier, _ = _run(workdir, 6, store=store, crash_at=5)
  assert crashed is None and tier.saved == [1, 2, 3, 5]   # 4 is a persistent save
  store[7] = (None, None, None)   # a newer step whose holder is gone: unreadable
  resumed, _, tier, _ = _run(workdir, 6, store=store)
  assert sorted(store) == [1, 2, 3, 5, 6]   # 7 set aside, 6 saved
  restart = [json.loads(line) for line in open(workdir / "metrics.jsonl", encoding="utf-8")
             if '"restart"' in line]
  assert [(row["step"], row["tier"]) for row in restart] == [(5, "memory")]
  assert tier.saved == [6]
  # Exact resume: the same losses as the uninterrupted run.
  assert _train_losses(workdir) == losses
  assert resumed.last_step == 6

  # Resumed from another tier at its last step (the bucket was down as the run ended):
  # nothing is left to train, and the persistent tier still gets that step.
  shutil.rmtree(workdir / "checkpoints" / "6")
  _run(workdir, 6, store=store)
  assert complete_steps(workdir / "checkpoints") == [4, 6]


def test_every_tier_implements_the_protocol(tmp_path):
  checkpointer = Checkpointer.for_run(RunDirectory(str(tmp_path), str(tmp_path / "l")),
                                      CheckpointConfig(), every=1)
  try:
    assert all(isinstance(tier, CheckpointTier)
               for tier in checkpointer.tiers + [InMemoryTier({})])
    assert [tier.name for tier in checkpointer.tiers] == ["persistent", "local"]
  finally:
    checkpointer.close()


def test_a_function_hook_sees_each_due_step_with_its_metrics():
  infos = []
  hook = hooks_lib.CallbackHook(infos.append, every=2)
  for step in range(1, 5):
    hook.on_metrics(step, {"loss": float(step)})
    if hook.is_due(step):
      hook.on_step(step, state=f"state {step}")
  assert [(i.step, i.state, i.metrics["loss"]) for i in infos] == [
      (2, "state 2", 2.0), (4, "state 4", 4.0)]
  assert hook.results() == {}


@pytest.mark.parametrize("every", [0, -1])
def test_a_function_hook_needs_a_positive_interval(every):
  with pytest.raises(ValueError, match="interval"):
    hooks_lib.CallbackHook(lambda info: None, every)
