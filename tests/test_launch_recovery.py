"""Automatic recovery in the cluster launchers: the scripts they render are run here.

The TPU VM worker command and the GKE container's command are executed by bash here,
and the training step is a real process that fails, succeeds or gets signalled: a
SIGTERM sent to the TPU VM worker's shell or to the GKE container's command must reach
that process, which saves, and is never restarted. The SLURM batch script runs on a
real SLURM cluster in tests/test_slurm_cluster.py; here only its form without restarts
is checked.
"""
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from launch.clusters import common
from launch.clusters import gke
from launch.clusters import slurm
from launch.clusters import tpu_vm
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


# A stand-in trainer: records each start and the signal it gets (after a short "save"),
# then exits 0 like pretrain.train; with `handler=False` SIGTERM kills it (exit 143).
def _trainer(record, handler=True):
  return ("import os, pathlib, signal, sys, time\n"
          f"p = pathlib.Path({str(record)!r})\n"
          "def log(text):\n  p.write_text((p.read_text() if p.exists() else '') + text + '\\n')\n"
          "def save(signum, _):\n  time.sleep(0.5); log(f'signal {signum}'); sys.exit(0)\n"
          + ("signal.signal(signal.SIGTERM, save)\n" if handler else "")
          + "log(f'start {os.getpid()} ' + os.environ.get('GRIFFIN_RESTART_ATTEMPT', '-'))\n"
          "print('TRAINING', flush=True)\n"
          "time.sleep(60)\n")


@pytest.mark.parametrize("max_restarts", [0, 3])
def test_tpu_vm_sigterm_reaches_the_trainer_which_saves_and_is_not_restarted(tmp_path,
                                                                          max_restarts):
  record = tmp_path / "record"
  line = tpu_vm.remote_command([sys.executable, "-c", _trainer(record)], str(tmp_path), "",
                               {"WANDB_MODE": "offline"}, max_restarts=max_restarts,
                               retry_delay_s=0)
  worker = subprocess.Popen(["bash", "-c", line], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
  assert worker.stdout.readline().strip() == "TRAINING"
  worker.send_signal(signal.SIGTERM)  # to the worker's shell only, as a `kill PID` would
  _, err = worker.communicate(timeout=60)
  lines = record.read_text().splitlines()
  assert len(lines) == 2 and lines[0].startswith("start "), lines  # started once
  assert lines[1] == f"signal {int(signal.SIGTERM)}"  # it got SIGTERM and saved
  assert worker.returncode == 0, err
  if max_restarts:
    assert "SIGTERM passed to the command, which exited with code 0; not restarting" in err
  else:  # no loop: the shell exec'd the trainer, so the signalled process is the trainer
    assert lines[0].split()[1] == str(worker.pid)


def test_tpu_vm_loop_does_not_restart_a_trainer_killed_by_sigterm(tmp_path):
  record = tmp_path / "record"
  line = tpu_vm.remote_command([sys.executable, "-c", _trainer(record, handler=False)],
                               str(tmp_path), "", {}, max_restarts=3, retry_delay_s=0)
  worker = subprocess.Popen(["bash", "-c", line], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
  assert worker.stdout.readline().strip() == "TRAINING"
  worker.send_signal(signal.SIGTERM)
  _, err = worker.communicate(timeout=60)
  assert worker.returncode == 128 + signal.SIGTERM
  assert len(record.read_text().splitlines()) == 1  # never started again
  assert "which exited with code 143; not restarting" in err


def test_tpu_vm_sigterm_during_the_retry_delay_ends_the_loop(tmp_path):
  counter = tmp_path / "count"
  step = (f"import pathlib, sys; p = pathlib.Path({str(counter)!r}); "
          "p.write_text(str(int(p.read_text()) + 1 if p.exists() else 1)); "
          "sys.exit(1)")
  line = tpu_vm.remote_command([sys.executable, "-c", step], str(tmp_path), "", {},
                               max_restarts=3, retry_delay_s=30)
  worker = subprocess.Popen(["bash", "-c", line], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
  assert "retry 1 of 3 in 30 s" in worker.stderr.readline()  # the loop is sleeping
  worker.send_signal(signal.SIGTERM)
  _, err = worker.communicate(timeout=20)  # well before the 30 s delay ends
  assert worker.returncode == 128 + signal.SIGTERM
  assert counter.read_text() == "1"
  assert "SIGTERM during the retry delay; not restarting" in err


def test_gke_container_command_is_the_trainer_itself(tmp_path):
  # The pod's command runs as is (no shell around it): run it here, signal that process
  # as the kubelet would, and the stand-in trainer saves.
  record = tmp_path / "record"
  manifest = gke.jobset_manifest("n", "i", [sys.executable, "-c", _trainer(record)],
                                 TpuSlice("v5p-16"))
  pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
  (container,) = pod["containers"]
  trainer = subprocess.Popen(container["command"], stdout=subprocess.PIPE, text=True)
  assert trainer.stdout.readline().strip() == "TRAINING"
  trainer.send_signal(signal.SIGTERM)
  assert trainer.wait(timeout=60) == 0
  assert record.read_text().splitlines()[1] == f"signal {int(signal.SIGTERM)}"
  assert pod["terminationGracePeriodSeconds"] == gke.MIN_GRACE_S
