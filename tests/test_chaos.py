"""launch.chaos: a 2-process training under SIGKILL and SIGTERM at random steps finishes
by itself with the uninterrupted run's losses; its report accounts every fault."""
import json
import os

import pytest

from launch import chaos
from pretrain import goodput
from pretrain.errors import UserError
from trainer_helpers import trainer_env  # pylint: disable=unused-import

STEPS = 16


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


@pytest.mark.slow
def test_chaos_run_recovers_from_sigkill_and_sigterm_with_equal_losses(
    trainer_env, tmp_path, monkeypatch):
  for name, value in trainer_env.env.items():
    monkeypatch.setenv(name, value)
  report = chaos.run_chaos(
      str(tmp_path / "chaos"), steps=STEPS, faults=2, seed=0, processes=2, devices=2,
      gin_files=[trainer_env.gin], gin_params=["BATCH_SIZE=8"], local_every=2,
      checkpoint_every=6, tolerance=1e-6, reference_workdir=None, timeout_s=400)
  print(report["text"])
  assert report["verdict"] == "pass", report["text"]
  assert all(f["recover_s"] is not None for f in report["faults"]), report["text"]
  assert report["loss_check"]["steps_compared"] == STEPS
  faults = {f["kind"]: f for f in report["faults"]}
  assert set(faults) == {"SIGKILL", "SIGTERM"}
  # A preemption saves the agreed step: nothing is lost, the persistent tier resumes.
  assert faults["SIGTERM"]["steps_lost"] == 0 and faults["SIGTERM"]["tier"] == "persistent"
  # A kill loses at most the local interval (plus a save still in flight).
  assert faults["SIGKILL"]["steps_lost"] <= 4
  assert all(f["recover_s"] > 0 for f in report["faults"])
  assert report["relaunches"] == 1   # after the preemption's clean exit
  assert len(report["restarts"]) == 2
  totals = report["goodput"]
  assert totals["sessions"] == 3 and totals["lost_steps"] >= faults["SIGKILL"]["steps_lost"]
  assert abs(sum(totals[n] for n in goodput.BREAKDOWN) - totals["wall"]) < 1e-6 * totals["wall"]
  assert totals["restore"] > 0 and totals["downtime"] > 0
  with open(tmp_path / "chaos" / "chaos_report.json", encoding="utf-8") as f:
    assert json.load(f)["verdict"] == "pass"
  with open(tmp_path / "chaos" / "chaos_report.txt", encoding="utf-8") as f:
    assert f.read().rstrip().endswith("verdict: pass")
  assert os.listdir(tmp_path / "chaos" / "local")   # the local tier was written
