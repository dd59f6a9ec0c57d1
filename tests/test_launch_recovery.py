"""Automatic recovery in the cluster launchers: the scripts they render are run here.

The TPU VM worker command is executed by bash, and the training step is a real process
that fails or succeeds. The SLURM batch script runs on a real SLURM cluster in
tests/test_slurm_cluster.py; here only its form without restarts is checked.
"""
import os
import pathlib
import subprocess
import sys

from launch import common
from launch import gke
from launch import slurm
from launch import tpu_vm
from sharding.tpu_slice import TpuSlice

REPO = pathlib.Path(__file__).resolve().parents[1]


def _script(command, max_restarts, time_limit=None):
  return slurm.batch_script(
      command, job_name="j", nodes=1, gpus_per_node=1, cpus_per_task=1,
      time_limit=time_limit, partition=None, account=None, output="o", chdir=None,
      setup="", env={}, max_restarts=max_restarts)


def test_slurm_without_restarts_is_a_plain_srun():
  script = _script(["python", "-c", "pass"], 0)
  assert "--requeue" not in script and "trap" not in script
  assert script.rstrip().endswith("srun --kill-on-bad-exit=1 python -c pass")


def test_gke_restarts_by_default():
  manifest = gke.jobset_manifest("n", "i", ["python"], TpuSlice("v5p-16"))
  assert manifest["spec"]["failurePolicy"]["maxRestarts"] == common.DEFAULT_MAX_RESTARTS > 0


def test_tpu_vm_workers_retry_until_the_command_succeeds(tmp_path):
  # Fails twice, then succeeds: counted in a file, as a resumed trainer would progress.
  counter = tmp_path / "count"
  step = (f"import pathlib, sys; p = pathlib.Path({str(counter)!r}); "
          "n = int(p.read_text()) if p.exists() else 0; p.write_text(str(n + 1)); "
          "sys.exit(0 if n >= 2 else 1)")
  line = tpu_vm.remote_command([sys.executable, "-c", step], str(tmp_path), "", {},
                               max_restarts=3, retry_delay_s=0)
  result = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  assert counter.read_text() == "3"
  assert result.stderr.count("tpu_vm: the command exited with code 1") == 2


def test_tpu_vm_retry_budget_spent_fails(tmp_path):
  line = tpu_vm.remote_command([sys.executable, "-c", "import sys; sys.exit(6)"],
                               str(tmp_path), "", {}, max_restarts=1, retry_delay_s=0)
  result = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60)
  assert result.returncode == 6
  assert "restart budget of 1 spent" in result.stderr


def test_tpu_vm_dry_run_retries_by_default():
  result = subprocess.run(
      [sys.executable, "-m", "launch.tpu_vm", "--tpu=t", "--zone=z", "--dry_run", "--",
       "python", "-m", "pretrain.train", "--workdir=gs://b/r"],
      capture_output=True, text=True, timeout=120, cwd=REPO,
      env={**os.environ, "PYTHONPATH": str(REPO)})
  assert result.returncode == 0, result.stderr
  assert f"restart budget of {common.DEFAULT_MAX_RESTARTS} spent" in result.stdout
  assert "GRIFFIN_RESTART_ATTEMPT=$attempt python -m pretrain.train" in result.stdout
