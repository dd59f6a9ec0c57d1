"""Automatic recovery in the cluster launchers: the scripts they render are run here.

The SLURM batch script and the TPU VM worker command are executed by bash with `srun`
and `scontrol` replaced by small shims on PATH (no cluster here); the shims record what
the script asked SLURM to do, and the training step is a real process that fails, gets
signalled, or succeeds. A SIGTERM sent to the TPU VM worker's shell or to the GKE
container's command must reach that process, which saves, and is never restarted.
"""
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from launch import common
from launch import gke
from launch import slurm
from launch import tpu_vm
from sharding.tpu_slice import TpuSlice

REPO = pathlib.Path(__file__).resolve().parents[1]
# srun shim: drops its own flags and runs the command; scontrol shim: logs its arguments.
SRUN = '#!/bin/bash\nshift\nexec "$@"\n'
SCONTROL = '#!/bin/bash\necho "$@" >> "$SCONTROL_LOG"\n'


def _script(command, max_restarts, time_limit=None):
  return slurm.batch_script(
      command, job_name="j", nodes=1, gpus_per_node=1, cpus_per_task=1,
      time_limit=time_limit, partition=None, account=None, output="o", chdir=None,
      setup="", env={}, max_restarts=max_restarts)


@pytest.fixture()
def cluster(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
    (bin_dir / name).write_text(text)
    (bin_dir / name).chmod(0o755)
  log = tmp_path / "scontrol.log"

  def start(script: str, restart_count: int) -> subprocess.Popen:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "SCONTROL_LOG": str(log), "SLURM_JOB_ID": "77",
           "SLURM_RESTART_COUNT": str(restart_count)}
    return subprocess.Popen(["bash", str(path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

  def requeues() -> list[str]:
    return log.read_text().splitlines() if log.exists() else []
  return start, requeues


def test_slurm_failed_step_requeues_within_budget(cluster):
  start, requeues = cluster
  job = start(_script([sys.executable, "-c", "import sys; sys.exit(3)"], 2), restart_count=1)
  _, err = job.communicate(timeout=60)
  assert job.returncode == 3
  assert requeues() == ["requeue 77"]
  assert "requeueing job 77 (restart 2 of 2)" in err


def test_slurm_spent_budget_does_not_requeue(cluster):
  start, requeues = cluster
  job = start(_script([sys.executable, "-c", "import sys; sys.exit(3)"], 2), restart_count=2)
  _, err = job.communicate(timeout=60)
  assert job.returncode == 3 and requeues() == []
  assert "restart budget of 2 spent" in err


def test_slurm_success_does_not_requeue(cluster):
  start, requeues = cluster
  job = start(_script([sys.executable, "-c", "print('done')"], 2), restart_count=0)
  out, _ = job.communicate(timeout=60)
  assert job.returncode == 0 and "done" in out and requeues() == []


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_slurm_preemption_signal_lets_the_step_save_then_requeues(cluster, signum):
  # The "trainer" saves on SIGTERM (writes SAVED) and exits 0, as pretrain.train does.
  step = ("import signal, sys, time\n"
          "def save(*_):\n  print('SAVED', flush=True); sys.exit(0)\n"
          "signal.signal(signal.SIGTERM, save)\n"
          "print('TRAINING', flush=True)\n"
          "time.sleep(60)\n")
  start, requeues = cluster
  job = start(_script([sys.executable, "-c", step], 3, time_limit="1:00:00"), restart_count=0)
  assert job.stdout.readline().strip() == "TRAINING"
  job.send_signal(signum)
  out, err = job.communicate(timeout=60)
  assert job.returncode == 0
  assert "SAVED" in out
  assert requeues() == ["requeue 77"]
  assert f"received SIG{signal.Signals(signum).name[3:]}" in err


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
