"""Exact resume: a run killed with SIGKILL (async saves in flight) and restarted with the
same command produces, step for step, the losses of an uninterrupted run."""
import os

import pytest

from pretrain.observability import goodput
from pretrain.checkpoints.persistent import complete_steps
from trainer_helpers import (assert_ok, kill_after_steps, read_metrics, train_losses,  # pylint: disable=unused-import
                             trained_workdir, trainer_env)

STEPS = 24          # 2N, as in the shared tiny config (saves every 2 steps)
KILL_AFTER = 12     # N: kill once this many steps are logged


@pytest.mark.slow
def test_sigkill_then_restart_reproduces_uninterrupted_losses(trainer_env, trained_workdir,
                                                               tmp_path):
  # (a) the uninterrupted run: the shared session run (its evaluations and final sample
  # do not touch the training state).
  reference = train_losses(trained_workdir[0])
  assert sorted(reference) == list(range(1, STEPS + 1))

  # (b) the same run killed with SIGKILL after about N steps, then restarted.
  workdir = str(tmp_path / "killed")
  command = trainer_env.train_command(workdir)
  kill_after_steps(trainer_env, command, workdir, KILL_AFTER)
  killed_at = max(train_losses(workdir))
  assert killed_at < STEPS
  checkpoint_dir = os.path.join(workdir, "checkpoints")
  resumable = complete_steps(checkpoint_dir)
  resume_step = resumable[-1] if resumable else 0

  result = trainer_env.run(command)
  assert_ok(result)
  if resumable:
    assert f"Resuming from the checkpoint of step {resume_step}" in result.stdout
  # The restart drops the rows logged after its checkpoint and logs those steps again:
  # one row per step, the restarted run's.
  restarted = train_losses(workdir)
  assert [row["step"] for row in read_metrics(workdir) if "kind" not in row] == list(
      range(1, STEPS + 1))
  for step in range(resume_step + 1, STEPS + 1):
    assert abs(restarted[step] - reference[step]) <= 1e-6, (
        step, restarted[step], reference[step], resume_step)
  # The restart is recorded: which steps were redone, and the time they and the restore
  # cost, in the second session's goodput.
  rows = read_metrics(workdir)
  (restart,) = [row for row in rows if row.get("kind") == goodput.RESTART]
  assert (restart["step"], restart["lost_steps"]) == (resume_step, killed_at - resume_step)
  assert restart["redone_to"] == killed_at and restart["downtime_s"] > 0
  first, second = goodput.last_rows_per_session(rows)
  assert second["lost_steps"] == killed_at - resume_step
  assert (second["restore_s"] > 0) == bool(resumable)
  totals = goodput.run_totals(rows)
  assert abs(sum(totals[n] for n in goodput.BREAKDOWN) - totals["wall"]) < 1e-6 * totals["wall"]
  assert totals["wall"] > first["wall_s"] + second["wall_s"]
  assert complete_steps(checkpoint_dir)[-1] == STEPS
