"""`python -m pretrain.train` end to end on a tiny corpus: outputs, metrics, resume, SIGTERM."""
import glob
import json
import math
import os
import signal
import time

import pytest

from pretrain.observability import goodput
from pretrain.observability import report
from pretrain.checkpoints.persistent import complete_steps
from trainer_helpers import (assert_ok, read_metrics,  # pylint: disable=unused-import
                             train_losses, trained_workdir, trainer_env)


@pytest.mark.slow
def test_run_writes_config_checkpoints_metrics_and_tensorboard(trained_workdir):
  workdir, result = trained_workdir
  with open(os.path.join(workdir, "config.gin"), encoding="utf-8") as f:
    operative = f.read()
  assert "TrainConfig.train_steps = %TRAIN_STEPS" in operative
  assert "TRAIN_STEPS = 24" in operative and "ModelConfig.width = 32" in operative
  assert complete_steps(os.path.join(workdir, "checkpoints")) == [20, 22, 24]  # keep 3
  assert glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))

  rows = read_metrics(workdir)
  train_rows = [r for r in rows if "loss" in r]
  assert [r["step"] for r in train_rows] == list(range(1, 25))
  for row in train_rows:
    for key in ("loss", "learning_rate", "tokens_per_second", "step_time_s", "grad_norm"):
      assert isinstance(row[key], float) and row[key] >= 0, (key, row)
    assert row["mfu"] is None      # CPU: no known peak
  assert train_rows[0]["learning_rate"] == 0.0                      # warm-up starts at 0
  assert abs(train_rows[2]["learning_rate"] - 1e-2) < 1e-8          # peak after 2 steps
  assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 0.5       # it learns
  eval_rows = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in eval_rows] == [12, 24]
  assert all(r["eval_loss"] > 0 and r["eval_tokens"] > 0 for r in eval_rows)
  # Byte vocabulary: a byte is a token, EOS a token of no byte, so the scored tokens per
  # byte (nats per byte over nats per token) are at least 1.
  assert all(r["eval_bits_per_byte"] * math.log(2) / r["eval_loss"] > 1 - 1e-6
             for r in eval_rows)
  # lm_eval's tiny_mc task on the live parameters, every 12 steps
  downstream_rows = [r for r in rows if "downstream/tiny_mc/acc" in r]
  assert [r["step"] for r in downstream_rows] == [12, 24]
  for row in downstream_rows:
    assert set(row) == {"step", "downstream/tiny_mc/acc", "downstream/tiny_mc/acc_norm"}
    assert all(0 <= row[k] <= 1 for k in row if k != "step")
  assert "step 24/24 | tiny_mc/acc " in result.stdout

  out = result.stdout
  assert "step 24/24 | loss" in out and "MFU n/a" in out and "ETA" in out and "tok/s" in out
  assert "eval_loss" in out and "eval_bits_per_byte" in out
  assert "Sample:\ndef " in out
  assert "Done: 24 steps, 3,072 tokens; this session" in out
  assert "run: 2 cpu device(s) in 1 process(es); mesh replica 1, data 2" in out
  assert "128 tokens/step; workdir " + workdir in out
  assert "validation loss" in out and f"checkpoints: {workdir}/checkpoints (newest: step 24)" in out
  assert f"next: python -m pretrain.evaluate --workdir={workdir}" in out
  assert result.stderr == "", result.stderr   # no third-party noise


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(trainer_env, tmp_path):
  workdir = str(tmp_path / "preempted")
  process = trainer_env.popen(trainer_env.train_command(
      workdir, "TRAIN_STEPS=400", "CHECKPOINT_EVERY=1000"))
  deadline = time.time() + 240
  while time.time() < deadline and len(train_losses(workdir)) < 3:
    time.sleep(0.05)
  assert process.poll() is None, process.stdout.read()
  process.send_signal(signal.SIGTERM)
  output, _ = process.communicate(timeout=120)
  assert process.returncode == 0, output
  assert "Preempted: saved step" in output
  steps = complete_steps(os.path.join(workdir, "checkpoints"))
  assert len(steps) == 1 and 3 <= steps[0] < 400
  assert max(train_losses(workdir)) == steps[0]


def _popen_until(trainer_env, workdir, *gin_params, steps=3):
  """Starts a run and returns it once `steps` steps are logged."""
  process = trainer_env.popen(trainer_env.train_command(workdir, *gin_params))
  deadline = time.time() + 240
  while time.time() < deadline and len(train_losses(workdir)) < steps:
    assert process.poll() is None, process.stdout.read()
    time.sleep(0.05)
  return process


def _rows_per_step(workdir, kind):
  steps = [row["step"] for row in read_metrics(workdir) if kind in row]
  assert len(steps) == len(set(steps)), f"duplicate {kind} rows: {steps}"
  return steps


@pytest.mark.slow
def test_ctrl_c_saves_and_reruns_never_duplicate_metric_rows(trainer_env, tmp_path):
  workdir = str(tmp_path / "stopped")
  settings = ("CHECKPOINT_EVERY=1000", "TrainConfig.final_eval=True")
  process = _popen_until(trainer_env, workdir, "TRAIN_STEPS=400", *settings)
  process.send_signal(signal.SIGINT)
  output, _ = process.communicate(timeout=120)
  assert process.returncode == 0, output
  assert "Ctrl-C: saving the current step" in output and "Preempted: saved step" in output
  assert "Traceback" not in output and "interrupted" not in output.splitlines()
  saved = complete_steps(os.path.join(workdir, "checkpoints"))
  assert len(saved) == 1 and 3 <= saved[0] < 400
  stopped = saved[0]
  assert _rows_per_step(workdir, "loss") == list(range(1, stopped + 1))

  # A resumed run continues after the saved step; its rows follow without repeats.
  finish = f"TRAIN_STEPS={stopped + 2}"
  result = trainer_env.run(trainer_env.train_command(workdir, finish, *settings))
  assert_ok(result)
  assert f"Resuming from the checkpoint of step {stopped}" in result.stdout
  assert _rows_per_step(workdir, "loss") == list(range(1, stopped + 3))
  assert _rows_per_step(workdir, "eval_loss") == [stopped + 2]
  # Rerunning the finished run evaluates again but appends nothing.
  result = trainer_env.run(trainer_env.train_command(workdir, finish, *settings))
  assert_ok(result)
  assert _rows_per_step(workdir, "loss") == list(range(1, stopped + 3))
  assert _rows_per_step(workdir, "eval_loss") == [stopped + 2]


@pytest.mark.slow
def test_second_ctrl_c_aborts_at_once(trainer_env, tmp_path):
  workdir = str(tmp_path / "aborted")
  process = _popen_until(trainer_env, workdir, "TRAIN_STEPS=400", "CHECKPOINT_EVERY=1000")
  process.send_signal(signal.SIGINT)
  for line in process.stdout:  # the first Ctrl-C is acknowledged before the second
    if line.startswith("Ctrl-C:"):
      break
  process.send_signal(signal.SIGINT)
  process.communicate(timeout=30)
  assert process.returncode == -signal.SIGINT


@pytest.mark.slow
def test_trained_run_logs_goodput_that_sums_to_its_wall_time(trained_workdir):
  workdir, result = trained_workdir
  rows = read_metrics(workdir)
  sessions = goodput.last_rows_per_session(rows)
  assert len(sessions) == 1
  last = sessions[0]
  assert last["step"] == 24
  parts = last["productive_s"] + sum(last[f"{n}_s"] for n in goodput.TIMED)
  assert abs(parts - last["wall_s"]) < 1e-6 * last["wall_s"]
  # Compilation, evaluations (at 12 and 24, and the sample), saves and steps all took time.
  for name in ("compile_s", "eval_s", "checkpoint_s", "productive_s", "startup_s"):
    assert last[name] > 0, (name, last)
  assert last["restore_s"] == 0 and last["lost_steps"] == 0
  assert "goodput " in result.stdout and "over 1 session:" in result.stdout


@pytest.mark.slow
def test_report_writes_plots_of_two_runs_side_by_side(trained_workdir, tmp_path):
  workdir, _ = trained_workdir
  second = tmp_path / "resumed"
  second.mkdir()
  # A second run: the same rows plus a restarted session.
  rows = read_metrics(workdir)
  extra = dict(goodput.last_rows_per_session(rows)[0], session=2, lost_s=1.0,
               lost_steps=3, downtime_s=5.0)
  with open(second / "metrics.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows + [extra])
  paths = report.write_report([workdir, str(second)], str(tmp_path / "plots"))
  assert [os.path.basename(p) for p in paths] == [
      "loss.png", "eval_loss.png", "throughput.png", "mfu.png", "goodput.png"]
  for path in paths:
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 5000, path
