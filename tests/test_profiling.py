"""Profiling on demand: `TrainConfig.profile_steps` captures a trace of those steps."""
import glob
import os

import jax
import jax.numpy as jnp
import pytest

from pretrain import hooks as hooks_lib
from pretrain.train_config import TrainConfig
from trainer_helpers import trained_workdir, trainer_env  # pylint: disable=unused-import


def _traces(logdir):
  return glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))


def _drive(hook, steps):
  """Runs `steps` fake optimizer steps through the hook as the loop would."""
  state = jnp.zeros(4)
  for step in steps:
    state = jax.jit(lambda x: x + 1)(state)
    if hook.is_due(step):
      hook.on_step(step, state)
  hook.close()


def test_trace_covers_the_window_only(tmp_path):
  hook = hooks_lib.ProfileHook(str(tmp_path), first=3, last=4, start_step=0)
  assert [s for s in range(1, 8) if hook.is_due(s)] == [2, 4]
  _drive(hook, range(1, 8))
  assert len(_traces(str(tmp_path))) == 1


def test_run_resumed_inside_the_window_traces_from_its_first_step(tmp_path):
  hook = hooks_lib.ProfileHook(str(tmp_path), first=1, last=6, start_step=3)
  _drive(hook, range(4, 8))
  assert len(_traces(str(tmp_path))) == 1


def test_run_resumed_after_the_window_traces_nothing(tmp_path):
  hook = hooks_lib.ProfileHook(str(tmp_path), first=1, last=2, start_step=5)
  _drive(hook, range(6, 8))
  assert _traces(str(tmp_path)) == []


@pytest.mark.parametrize("steps", [(0, 3), (5, 2), (1, 2, 3), (1.5, 2)])
def test_bad_window_is_rejected(steps):
  with pytest.raises(ValueError, match="profile_steps"):
    TrainConfig(profile_steps=steps)


@pytest.mark.slow
def test_train_with_profile_steps_writes_a_trace(trained_workdir):  # noqa: F811
  workdir, _ = trained_workdir  # trained with TrainConfig.profile_steps=(2, 3)
  assert len(_traces(os.path.join(workdir, "profile"))) == 1
