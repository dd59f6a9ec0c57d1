"""`launch.slurm` on a real two-node SLURM cluster (tests/slurm_cluster.py).

One tiny Griffin run of STEPS steps, 2 nodes x 2 tasks (one CPU device each), is the
reference when trained by `launch.local` with 4 processes on this host. On the cluster,
the README's SLURM example, submitted verbatim, is interrupted four ways:
  1. the time-limit warning (`scancel --signal=USR1 --batch`: the signal that
     `--signal=B:USR1@S` makes SLURM send to the batch shell at the warning time);
  2. a preemption: a job of the `urgent` partition takes both nodes, SLURM sends
     SIGTERM to the tasks and requeues the job after the grace time;
  3. `scancel --signal=TERM`, as an operator draining nodes sends it;
  4. a task killed with SIGKILL on the second node.
After 1-3 every task saves the step they agree on and the job requeues; after 4 srun
ends the step and the job requeues from the newest checkpoint. The job completes with
the reference's losses at every step, and no step before a signal is trained twice.
A job whose step keeps failing spends its restart budget and ends FAILED with one line.

Every run shares the session's token store and compilation cache.
"""
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from slurm_cluster import SlurmCluster, unavailable_reason
from test_readme import PIECES
from trainer_helpers import REPO, assert_ok, read_metrics, trainer_env  # pylint: disable=unused-import

pytestmark = pytest.mark.slow

STEPS = 32
NODES, TASKS_PER_NODE = 2, 2
README_SLURM = [p for p in PIECES if p.startswith("python -m launch.slurm") and
                "--dry_run" not in shlex.split(p)]


def _extra_params(corpus):
  """The README's quickstart command, shrunk (GRIFFIN_EXTRA_GIN_PARAMS) to a tiny model
  on the tests' corpus."""
  return "\n".join([
      f"TRAIN_STEPS = {STEPS}", "BATCH_SIZE = 4", "SEQUENCE_LENGTH = 32",
      "EVAL_EVERY = 0", "LOG_EVERY = 1",
      f"TRAIN_FILES = '{corpus}/*.txt'", "ModelConfig.width = 32",
      "ModelConfig.rnn_width = 32", "ModelConfig.num_heads = 2", "ModelConfig.depth = 3",
      "ModelConfig.attention_window = 8", "TrainConfig.sample_tokens = 4",
      "TrainConfig.eval_batches = 1", "TrainConfig.final_eval = False",
      "CHECKPOINT_EVERY = 4"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  reason = unavailable_reason()
  if reason:
    if os.environ.get("CI"):
      pytest.fail(reason)
    pytest.skip(reason)
  started = SlurmCluster(str(tmp_path_factory.mktemp("slurm"))).start()
  yield started
  started.stop()


@pytest.fixture(scope="module")
def run_env(trainer_env, cluster):
  env = cluster.env(trainer_env.env)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  env["GRIFFIN_EXTRA_GIN_PARAMS"] = _extra_params(trainer_env.corpus)
  return env


def _train_command(workdir):
  return ["python", "-m", "pretrain.train", "--gin_file=configs/quickstart.gin",
          f"--workdir={workdir}"]


@pytest.fixture(scope="module")
def reference(run_env, tmp_path_factory):
  """{step: loss} of the run under launch.local, 4 processes on this host (which also
  builds the token store the cluster's tasks read)."""
  workdir = str(tmp_path_factory.mktemp("local") / "run")
  result = subprocess.run(
      [sys.executable, "-m", "launch.local", f"--num_processes={NODES * TASKS_PER_NODE}",
       "--devices_per_process=1", "--", *_train_command(workdir)],
      env=run_env, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert_ok(result)
  losses = _train_rows(workdir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  for step, rows in losses.items():
    assert all(loss == reference[step] for loss in rows), (step, rows, reference[step])
  # What each restart trained again (contracts.md, "Resume"): nothing after a signal.
  restarts = [row for row in read_metrics(workdir) if row.get("kind") == "restart"]
  assert [row["step"] for row in restarts] == resumed, restarts
  assert [row["lost_steps"] for row in restarts[:3]] == [0, 0, 0], restarts


def test_spent_restart_budget_ends_the_job_with_one_line(cluster, run_env, tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "launch.slurm", "--nodes=1", "--gpus_per_node=1",
       "--cpus_per_task=1", "--partition=gpu", "--max_restarts=1",
       f"--output={tmp_path}/slurm-%j.out", "--", "python", "-c", "raise SystemExit(3)"],
      env=run_env, cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
  assert_ok(result)
  job = re.search(r"Submitted batch job (\d+)", result.stdout).group(1)
  record = cluster.wait_for(job, ["FAILED", "COMPLETED", "CANCELLED"], timeout_s=120)
  output = _output(tmp_path, job)
  assert record["JobState"] == "FAILED" and record["ExitCode"] == "1:0", (record, output)
  assert record["Restarts"] == "1", record
  lines = [line for line in output.splitlines() if line.startswith("launch.slurm:")]
  assert lines == [
      "launch.slurm: the training step exited with code 3; requeueing job "
      f"{job} (restart 1 of 1)",
      "launch.slurm: the training step exited with code 3; the restart budget of 1 is "
      "spent, so the job ends here (submit it again to resume from the newest "
      "checkpoint)"], output
