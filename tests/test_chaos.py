"""launch.chaos's fault plan and loss comparison. The chaos run itself (a 2-process
training under SIGKILL and SIGTERM that must end with the uninterrupted run's losses) is
in tests/test_multihost_train.py, where it shares that module's uninterrupted run."""
import os

import pytest

from launch import chaos
from plumbing.errors import UserError


def test_fault_plan_is_seeded_mixed_and_inside_the_run():
  plan = chaos.plan_faults(200, 5, 2, seed=0)
  assert plan == chaos.plan_faults(200, 5, 2, seed=0)
  assert plan != chaos.plan_faults(200, 5, 2, seed=1)
  steps = [f.planned_step for f in plan]
  assert steps == sorted(set(steps)) and 20 <= steps[0] and steps[-1] < 150
  assert {f.kind for f in plan} == {"SIGKILL", "SIGTERM"}
  assert {f.process for f in plan} <= {0, 1}
  with pytest.raises(UserError, match="--faults=9 do not fit in --steps=8"):
    chaos.plan_faults(8, 9, 2, seed=0)


def test_loss_comparison_flags_differences_and_missing_steps():
  reference = {1: 5.0, 2: 4.0, 3: 3.0}
  assert chaos.compare_losses(reference, {1: 5.0, 2: 4.0 * (1 + 5e-7), 3: 3.0},
                              1e-6)["equal"]
  different = chaos.compare_losses(reference, {1: 5.0, 2: 4.0 * (1 + 2e-6), 3: 3.0}, 1e-6)
  assert not different["equal"] and different["mismatched_steps"] == [2]
  missing = chaos.compare_losses(reference, {1: 5.0, 2: 4.0}, 1e-6)
  assert not missing["equal"] and missing["missing_steps"] == [3]


def test_report_names_a_restart_from_scratch():
  """Without a local tier a kill before the first persistent save restarts at step 0."""
  fault = dict(kind="SIGKILL", process=0, at_step=30, resumed_step=0, tier=None,
               steps_lost=30, recover_s=86.0)
  report = dict(processes=2, devices_per_process=2, steps=200, seed=0, local_every=0,
                checkpoint_every=None, faults=[fault], goodput=None, median_recover_s=86.0,
                steps_lost=30, wall_s=600.0, relaunches=0, verdict="pass",
                loss_check=dict(steps_compared=200, max_rel_diff=0.0, equal=True,
                                tolerance=1e-6))
  text = chaos.format_report(report)
  assert "local tier off" in text
  row = text.splitlines()[2].split()
  assert row[:6] == ["1", "SIGKILL", "0", "30", "0", "(scratch)"], text


def test_storage_fault_kinds_are_planned_and_checked():
  plan = chaos.plan_faults(200, 8, 2, seed=0, kinds=chaos.KINDS)
  assert {f.kind for f in plan} == {"SIGKILL", "SIGTERM", "corrupt", "hang"}
  with pytest.raises(UserError, match="unknown fault kind"):
    chaos.plan_faults(200, 2, 2, seed=0, kinds=("flood",))
  with pytest.raises(UserError, match="hang needs --num_processes >= 2"):
    chaos.plan_faults(200, 2, 1, seed=0, kinds=("hang",))


def _step(root, step, item, size):
  """A committed step directory holding one file of `size` bytes under `item`."""
  os.makedirs(os.path.join(root, str(step), item))
  with open(os.path.join(root, str(step), "commit_success.txt"), "w") as f:
    f.write("done")
  path = os.path.join(root, str(step), item, "data")
  with open(path, "wb") as f:
    f.write(b"x" * size)
  return path


def test_corrupt_tears_the_newest_step_of_either_tier(tmp_path):
  workdir, local = str(tmp_path / "run"), str(tmp_path / "local")
  old = _step(os.path.join(workdir, "checkpoints"), 4, "params", 100)
  newest = _step(os.path.join(workdir, "checkpoints"), 8, "params", 100)
  shards = [_step(os.path.join(local, "key", f"process_{i}_of_2"), 6, "shards", 100)
            for i in range(2)]
  assert chaos.corrupt_newest_checkpoint(workdir, local) == "checkpoint 8"
  assert [os.path.getsize(p) for p in (old, newest, *shards)] == [100, 50, 100, 100]
  shards = [_step(os.path.join(local, "key", f"process_{i}_of_2"), 10, "shards", 100)
            for i in range(2)]
  assert chaos.corrupt_newest_checkpoint(workdir, local) == "local checkpoint 10"
  assert [os.path.getsize(p) for p in shards] == [50, 50]
  assert chaos.corrupt_newest_checkpoint(str(tmp_path / "empty"), None) is None
