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
The next rows do not depend on the job's shape and run the README example on one node
with one task (a quarter of the processes on the two cores the tests share), against a
reference of one process. A job cancelled with `scancel JOB` or `scancel --full JOB`
saves and ends CANCELLED, never requeued; with `scancel --signal=TERM --batch JOB` it
saves and ends FAILED (143), never requeued; with `scancel --signal=TERM --full JOB`
srun kills the tasks before they save (SLURM's doing), and it ends FAILED (143) with its
periodic checkpoints only. A job that reaches its time limit with no warning saves
within KillWait, requeues and finishes with the reference's losses. Back on two nodes
and four tasks, a job that loses a node is requeued by SLURM and resumes from its
newest checkpoint once the node is back. A submission sbatch refuses is sbatch's message
and one line.

Every run shares the session's token store and compilation cache.
"""
import contextlib
import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

import slurm_cluster
from launch.clusters import slurm as slurm_backend
from launch.dispatch import scheduler
from launch.dispatch import sweep_job
from plumbing.errors import UserError
from pretrain.checkpoints.persistent import complete_steps
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
  return {step: rows[0] for step, rows in losses.items()}


@pytest.fixture(scope="module")
def one_task_reference(run_env, tmp_path_factory):
  """{step: loss} of the run as one process on one device, the shape of the jobs
  `_submit_readme_example(..., one_task=True)` submits."""
  workdir = str(tmp_path_factory.mktemp("one_task") / "run")
  result = subprocess.run(_train_command(workdir), env=run_env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
  assert_ok(result)
  losses = _train_rows(workdir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  return {step: rows[0] for step, rows in losses.items()}


def _train_rows(workdir):
  """{step: [loss of each time the step was trained]}."""
  rows = {}
  for row in read_metrics(workdir):
    if "loss" in row:
      rows.setdefault(row["step"], []).append(row["loss"])
  return rows


def _output(cwd, job):
  path = os.path.join(str(cwd), f"slurm-{job}.out")
  if not os.path.exists(path):
    return ""
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()


def _wait_for_step(cluster, job, workdir, cwd, step, timeout_s=240):
  """Waits until the run has logged `step` (or more)."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    steps = [row["step"] for row in read_metrics(workdir) if "loss" in row]
    if steps and max(steps) >= step:
      return
    state = cluster.job(job).get("JobState")
    assert state in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING"), (
        state, _output(cwd, job)[-3000:])
    time.sleep(0.5)
  raise AssertionError(f"step {step} not reached in {timeout_s} s\n"
                       f"{_output(cwd, job)[-3000:]}")


def _wait_for_restart(cluster, job, restarts, timeout_s=120):
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if int(cluster.job(job).get("Restarts", 0)) >= restarts:
      return
    time.sleep(0.5)
  raise AssertionError(f"job {job} not requeued {restarts} time(s) in {timeout_s} s")


def _story(text):
  """The lines of a job's output that tell what happened to it: the batch shell's
  `launch.slurm:` lines and the trainer's saves and resumes (an assertion's message)."""
  keep = ("launch.slurm:", "Resuming from", "Preempted:", "Starting a new run", "slurmstepd")
  return "\n".join(line for line in text.splitlines() if line.startswith(keep))


def _saved_steps(text):
  return [int(s) for s in re.findall(r"the run saved step (\d+)", text)]


def _trainer_pids(namespaces, workdir_flag):
  """The pids of the training processes with `workdir_flag` in their argv running in
  `namespaces` (the trainers themselves, not launch.sweep_job around them)."""
  found = []
  for namespace in namespaces:
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                          text=True, check=True).stdout.split()
    for pid in pids:
      try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
          argv = f.read().split(b"\0")
      except FileNotFoundError:
        continue
      if argv[1:3] == [b"-m", b"pretrain.train"] and workdir_flag.encode() in argv:
        found.append(int(pid))
  return found


def _trainer_pid(namespaces, workdir_flag):
  """The pid of one training process with `workdir_flag` in `namespaces`, or None."""
  pids = _trainer_pids(namespaces, workdir_flag)
  return pids[0] if pids else None


def _submit_readme_example(run_env, cwd, without_time=False, one_task=False):
  """Submits the README's SLURM example, verbatim, from `cwd`: (job id, its --workdir
  flag, the workdir). `without_time`: less its `--time` flag, so the job has no time
  limit and no time-limit warning (`--signal=B:USR1@S` comes with `--time` only).
  `one_task`: on one node with one task (`--nodes=1 --gpus_per_node=1`), for the rows
  whose promise does not depend on the job's shape: a quarter of the processes to start
  on the two cores the tests share, compared with `one_task_reference`."""
  assert len(README_SLURM) == 1, README_SLURM
  words = shlex.split(README_SLURM[0])
  if without_time:
    assert sum(word.startswith("--time=") for word in words) == 1, words
    words = [word for word in words if not word.startswith("--time=")]
  if one_task:
    shape = {"--nodes": "1", "--gpus_per_node": "1"}
    assert sum(word.split("=")[0] in shape for word in words) == len(shape), words
    words = [f"{word.split('=')[0]}={shape[word.split('=')[0]]}"
             if word.split("=")[0] in shape else word for word in words]
  command = shlex.join(words) if (without_time or one_task) else README_SLURM[0]
  os.symlink(os.path.join(REPO, "tests"), cwd / "tests")
  result = subprocess.run(command, shell=True, cwd=cwd, env=run_env,
                          capture_output=True, text=True, timeout=60)
  assert_ok(result)
  job = re.search(r"Submitted batch job (\d+)", result.stdout).group(1)
  workdir_flag = re.search(r"--workdir=\S+", README_SLURM[0]).group(0)
  return job, workdir_flag, str(cwd / workdir_flag.split("=", 1)[1])


def test_a_controller_that_does_not_answer_costs_one_line_and_a_bounded_wait(
    cluster, tmp_path, monkeypatch):
  """slurmctld stopped (SIGSTOP: its socket still accepts, nothing answers, as a hung
  controller): sbatch, which would wait MessageTimeout and retry, is given up after
  GRIFFIN_SCHEDULER_TIMEOUT_S, and `launch.slurm` ends with one line naming it and the
  check. So is squeue, which a sweep asks about each run it submitted (`job_alive`):
  `launch.sweep --backend=slurm` run again to see progress ends with one line too."""
  with open(os.path.join(cluster.root, "ctld", "pid"), encoding="ascii") as f:
    controller = int(f.read())
  for name, value in cluster.env().items():
    monkeypatch.setenv(name, value)
  monkeypatch.setenv(scheduler.TIMEOUT_ENV, "3")
  os.kill(controller, signal.SIGSTOP)
  try:
    began = time.monotonic()
    with pytest.raises(UserError, match="^sbatch did not answer in 3 s"):
      scheduler.run(["sbatch", "--wrap=true"], stdout=True, stderr=True)
    waited_s = time.monotonic() - began
    result = subprocess.run(
        [sys.executable, "-m", "launch.slurm", "--nodes=1", "--gpus_per_node=1",
         f"--output={tmp_path}/%j.out", "--", "true"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    # A sweep's status: a run it submitted (its array task) is looked up with squeue.
    began = time.monotonic()
    with pytest.raises(UserError, match="^squeue did not answer in 3 s"):
      slurm_backend.SweepBackend().job_alive("1_0")
    squeue_s = time.monotonic() - began
    study = tmp_path / "study"
    (study / "runs" / "hawk_20k").mkdir(parents=True)
    sweep_job.write_status(str(study / "runs" / "hawk_20k"), {
        "state": "submitted", "backend": "slurm", "job_id": "1_0", "failures": 0})
    status = subprocess.run(
        [sys.executable, "-m", "launch.sweep", "--families=hawk", "--sizes=20k",
         f"--workdir={study}", "--backend=slurm"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
  finally:
    os.kill(controller, signal.SIGCONT)
  assert 3 <= waited_s < 3 + 2, waited_s
  assert result.returncode == 1, result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      "error: sbatch did not answer in 3 s: is slurmctld (scontrol ping) up?"), result.stderr
  assert 3 <= squeue_s < 3 + 2, squeue_s
  assert status.returncode == 1, status.stderr
  lines = status.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      "error: squeue did not answer in 3 s: is slurmctld (scontrol ping) up?"), status.stderr
  # As the line warns, the submissions may have reached the controller: none is left
  # for the tests that follow.
  cluster.client("scancel", "--user=root", check=False)
  _wait_until_queue_empty(cluster, timeout_s=60)


@pytest.mark.soak   # 4 tasks, 5 sessions and a 4-process reference: about 9 minutes
def test_readme_example_survives_warning_preemption_scancel_and_a_killed_task(
    cluster, run_env, reference, tmp_path):
  """The README's SLURM example, verbatim, interrupted four ways; it ends with the
  reference's losses at every step."""
  job, workdir_flag, workdir = _submit_readme_example(run_env, tmp_path)

  def progress(steps):
    saved = _saved_steps(_output(tmp_path, job))
    _wait_for_step(cluster, job, workdir, tmp_path, (saved[-1] if saved else 0) + steps)

  def restart_count():
    return int(cluster.job(job).get("Restarts", 0))

  # Each interruption waits for one more restart than the job had just before it: SLURM
  # may preempt the requeued job once more if it starts before the urgent job does,
  # which is one more restart of the same kind (and nothing lost), not a defect.
  # 1. The time-limit warning: what `--signal=B:USR1@S` makes SLURM send.
  progress(3)
  cluster.client("scancel", "--signal=USR1", "--batch", job)
  _wait_for_restart(cluster, job, 1)
  # 2. A preemption: a job of the higher-priority partition takes both nodes.
  progress(2)
  before = restart_count()
  urgent = cluster.client("sbatch", "--parsable", "--partition=urgent", f"--nodes={NODES}",
                          "--exclusive", f"--output={tmp_path}/urgent-%j.out",
                          "--wrap=sleep 1").strip()
  _wait_for_restart(cluster, job, before + 1)
  assert cluster.wait_for(urgent, ["COMPLETED"], timeout_s=120)["ExitCode"] == "0:0"
  # 3. scancel with a signal, as an operator draining the nodes sends it.
  progress(2)
  before = restart_count()
  cluster.client("scancel", "--signal=TERM", job)
  _wait_for_restart(cluster, job, before + 1)
  # 4. A task dies (SIGKILL, on the second node): srun ends the step, the job requeues
  #    and resumes from the newest checkpoint.
  progress(3)
  before = restart_count()
  pid = _trainer_pid([cluster.namespace("n2")], workdir_flag)
  assert pid, f"no training process with {workdir_flag} on node2"
  os.kill(pid, signal.SIGKILL)
  _wait_for_restart(cluster, job, before + 1)
  killed_restart = before + 1
  record = cluster.wait_for(job, ["COMPLETED", "FAILED", "CANCELLED"], timeout_s=300)
  output = _output(tmp_path, job)
  story = _story(output)
  assert record["JobState"] == "COMPLETED", story
  assert f"{NODES * TASKS_PER_NODE} cpu device(s) in {NODES * TASKS_PER_NODE} process" in output
  assert "received SIGUSR1; sending SIGTERM to the training tasks" in output, story
  assert output.count("preempted (SIGUSR1); the run saved step") == 1, story
  signalled = output.count("preempted (SIGTERM to the tasks); the run saved step")
  assert signalled == killed_restart - 2, story   # the preemption(s) and the scancel
  assert "forcing job termination" not in output, story
  assert re.search(r"the training step exited with code \d+; requeueing job \d+ "
                   rf"\(restart {killed_restart} of 5\)", output), story
  saved = _saved_steps(output)
  assert len(saved) == killed_restart - 1 and saved == sorted(set(saved)), story
  resumed = [int(s) for s in re.findall(r"Resuming from the checkpoint of step (\d+)", output)]
  assert resumed[:-1] == saved and resumed[-1] >= saved[-1], story
  losses = _train_rows(workdir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  for step, rows in losses.items():
    assert all(loss == reference[step] for loss in rows), (step, rows, reference[step])
  # What each restart trained again (contracts.md, "Resume"): nothing after a signal.
  restart_rows = [row for row in read_metrics(workdir) if row.get("kind") == "restart"]
  assert [row["step"] for row in restart_rows] == resumed, restart_rows
  assert [row["lost_steps"] for row in restart_rows[:-1]] == [0] * len(saved), restart_rows


def _cancel_after_step(cluster, run_env, cwd, step, *scancel, checkpointed=False):
  """Submits the README example from `cwd` as one task, holds it at `step`
  (`_held_at_step`), runs `scancel` (the command and its flags) on the job and waits
  until the job has left the running states: (job id, workdir). `checkpointed`: waits
  for a complete periodic checkpoint before the cancel."""
  job, workdir_flag, workdir = _submit_readme_example(run_env, cwd, one_task=True)
  with _held_at_step(cluster, job, workdir_flag, workdir, cwd, step):
    if checkpointed:
      _wait_for_checkpoint(workdir, timeout_s=120)
    cluster.client(*scancel, job)
    _wait_for_output(cwd, job, "launch.slurm: received SIGTERM")
  cluster.wait_for(job, ["CANCELLED", "PENDING", "COMPLETED", "FAILED"], timeout_s=120)
  return job, workdir


@contextlib.contextmanager
def _held_at_step(cluster, job, workdir_flag, workdir, cwd, step):
  """Waits until the one-task job has trained `step`, then slows its task to a fiftieth
  of its speed (`_throttled`) for the block: one process trains the tiny job's 32 steps
  in a few seconds, and the job would otherwise end before the signal that the block
  sends has reached it. A tenth was not enough for the time limit, which slurmctld
  enforces up to 90 s after it is set: in a full run the task trained its last step
  first."""
  _wait_for_step(cluster, job, workdir, cwd, step)
  pids = _trainer_pids([cluster.namespace(f"n{i + 1}") for i in range(NODES)], workdir_flag)
  assert len(pids) == 1, (pids, _story(_output(cwd, job)))
  with _throttled(pids, duty=0.02):
    yield


def _wait_for_output(cwd, job, text, timeout_s=150):
  deadline = time.monotonic() + timeout_s
  while text not in _output(cwd, job):
    assert time.monotonic() < deadline, (text, _story(_output(cwd, job)))
    time.sleep(0.5)


def _wait_for_checkpoint(workdir, timeout_s=60):
  """The newest complete checkpoint's step, once there is one."""
  checkpoints = os.path.join(workdir, "checkpoints")
  deadline = time.monotonic() + timeout_s
  while not complete_steps(checkpoints):
    assert time.monotonic() < deadline, f"no complete checkpoint in {timeout_s} s"
    time.sleep(0.5)
  return max(complete_steps(checkpoints))


def _assert_never_requeued(cluster, job, state):
  """The job is `state` and stays so, never requeued: a requeue would have come from
  the batch shell before it exited, which the job waits for; watch for longer than SLURM
  holds a requeued job back all the same."""
  deadline = time.monotonic() + slurm_cluster.REQUEUE_DELAY_S + 5
  while time.monotonic() < deadline:
    record = cluster.job(job)
    assert (record["JobState"], record["Restarts"]) == (state, "0"), record
    assert not cluster.client("squeue", "--noheader", f"--jobs={job}").strip()
    time.sleep(1)
  return record


def _assert_saved_once_as_cancelled(job, workdir, output, reference):
  """The batch shell took a SIGTERM as a cancel, the tasks saved one step (3 or more,
  complete), and every step up to it was trained once, with the reference's loss."""
  saved = _saved_steps(output)
  assert len(saved) == 1, output[-3000:]
  saved = saved[0]
  assert [line for line in output.splitlines() if line.startswith("launch.slurm:")] == [
      f"launch.slurm: received SIGTERM: job {job} was cancelled; the training tasks save "
      "their current step if they can",
      f"launch.slurm: job {job} was cancelled; the run saved step {saved}; not requeueing "
      "it"], output[-3000:]
  losses = _train_rows(workdir)
  assert saved >= 3 and max(losses) == saved, (saved, sorted(losses))
  assert saved in complete_steps(os.path.join(workdir, "checkpoints")), saved
  assert all(rows == [reference[step]] for step, rows in losses.items()), losses


@pytest.mark.parametrize("how", [["scancel"], ["scancel", "--full"]],
                         ids=["scancel", "scancel-full"])
def test_a_cancelled_job_saves_and_stays_cancelled(cluster, run_env, one_task_reference,
                                                    tmp_path, how):
  """`scancel JOB` and `scancel --full JOB` (no signal) are the same cancel: SIGTERM to
  every process of the job, the tasks, srun (whose "forcing job termination" finds the
  step cancelled already and leaves the tasks be) and the batch shell. The tasks save
  the step they agree on, and the job ends CANCELLED, never requeued."""
  job, workdir = _cancel_after_step(cluster, run_env, tmp_path, 3, *how)
  _assert_never_requeued(cluster, job, "CANCELLED")
  _assert_saved_once_as_cancelled(job, workdir, _output(tmp_path, job), one_task_reference)


def test_scancel_term_to_the_batch_shell_saves_and_ends_the_job_failed(
    cluster, run_env, one_task_reference, tmp_path):
  """`scancel --signal=TERM --batch JOB` reaches the batch shell alone. Its record names
  no time limit and no requeue, so the shell takes it as a cancel: it forwards SIGTERM to
  the tasks, which save the step they agree on, and it exits 143 once srun has: the job
  ends FAILED, never requeued (an operator's own SIGTERM to the shell means stop)."""
  job, workdir = _cancel_after_step(cluster, run_env, tmp_path, 3, "scancel",
                                    "--signal=TERM", "--batch")
  record = _assert_never_requeued(cluster, job, "FAILED")
  output = _output(tmp_path, job)
  assert record["ExitCode"] == "143:0", (record, _story(output))
  _assert_saved_once_as_cancelled(job, workdir, output, one_task_reference)


def test_scancel_term_full_loses_the_steps_since_the_newest_checkpoint(
    cluster, run_env, one_task_reference, tmp_path):
  """`scancel --signal=TERM --full JOB` reaches srun as well as the tasks and the batch
  shell, and srun answers SIGTERM by killing its tasks at once: SLURM's doing, which no
  batch script can undo (the shell never signals srun itself for that reason). The
  shell takes the signal as a cancel, and the job ends FAILED (exit 143), never
  requeued; nothing is saved after the notice, so the newest checkpoint is a periodic
  one (every CHECKPOINT_EVERY steps) and the steps since it are lost."""
  job, workdir = _cancel_after_step(cluster, run_env, tmp_path, 5, "scancel",
                                    "--signal=TERM", "--full", checkpointed=True)
  record = _assert_never_requeued(cluster, job, "FAILED")
  output = _output(tmp_path, job)
  story = _story(output)
  assert record["ExitCode"] == "143:0", (record, story)
  assert not _saved_steps(output), story
  lines = [line for line in output.splitlines() if line.startswith("launch.slurm:")]
  assert lines == [
      f"launch.slurm: received SIGTERM: job {job} was cancelled; the training tasks save "
      "their current step if they can",
      f"launch.slurm: job {job} was cancelled; the run saved no step (the step exited "
      "with code 137); not requeueing it"], story
  checkpoints = complete_steps(os.path.join(workdir, "checkpoints"))
  losses = _train_rows(workdir)
  assert checkpoints and max(checkpoints) % 4 == 0 and max(checkpoints) >= 4, checkpoints
  assert max(losses) >= 5, sorted(losses)
  assert all(rows == [one_task_reference[step]] for step, rows in losses.items()), losses


def _signal_all(pids, signum):
  """Sends `signum` to each of `pids` that still exists."""
  for pid in pids:
    try:
      os.kill(pid, signum)
    except ProcessLookupError:
      pass


@contextlib.contextmanager
def _throttled(pids, duty=0.1, period_s=0.5):
  """Lets `pids` run a `duty` fraction of each `period_s` (SIGCONT, then SIGSTOP for the
  rest, as a CPU quota would) until the block ends, when they are continued. Every
  thread of a process keeps running now and then, so JAX's heartbeats still reach the
  coordination service (a task stopped outright for 45 s was declared dead)."""
  done = threading.Event()
  def cycle():
    while not done.is_set():
      _signal_all(pids, signal.SIGCONT)
      done.wait(duty * period_s)
      _signal_all(pids, signal.SIGSTOP)
      done.wait((1 - duty) * period_s)
  thread = threading.Thread(target=cycle, daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()
    thread.join()
    _signal_all(pids, signal.SIGCONT)


@pytest.mark.soak   # waits for slurmctld's one-minute limit: about 2 minutes
def test_the_time_limit_without_a_warning_saves_and_requeues(
    cluster, run_env, one_task_reference, tmp_path):
  """A job without a time-limit warning (no `--time` at submission, so no
  `--signal=B:USR1@S`) reaches its limit: SLURM sends SIGTERM (and SIGCONT) to every
  process of the job, srun and the batch shell included, and SIGKILL after KillWait. The
  shell tells it from a cancel by the reason slurmctld gives (`TimeLimit`), the tasks
  save within KillWait (srun, "forcing job termination", waits that long for them), and
  the shell requeues the job, which resumes and ends with the reference's losses.

  The limit is the real one of slurmctld, one minute (its smallest), set on the running
  job (`scontrol update JobId=N TimeLimit=1`; the controller checks limits every 30 s or
  so). The tiny job trains its 32 steps in seconds, so once it has trained 3 the test
  slows its task to a fiftieth of its speed (`_held_at_step`) until the limit has come.
  The requeued job's limit is lifted again so that it
  finishes."""
  job, workdir_flag, workdir = _submit_readme_example(run_env, tmp_path, without_time=True,
                                                      one_task=True)
  assert cluster.job(job)["TimeLimit"] in ("UNLIMITED", "INFINITE"), cluster.job(job)
  with _held_at_step(cluster, job, workdir_flag, workdir, tmp_path, 3):
    cluster.client("scontrol", "update", f"JobId={job}", "TimeLimit=1")
    _wait_for_output(tmp_path, job, "DUE TO TIME LIMIT")
  _wait_for_restart(cluster, job, 1, timeout_s=150)
  cluster.client("scontrol", "update", f"JobId={job}", "TimeLimit=UNLIMITED")
  record = cluster.wait_for(job, ["COMPLETED", "FAILED", "CANCELLED"], timeout_s=300)
  output = _output(tmp_path, job)
  story = _story(output)
  assert (record["JobState"], record["Restarts"]) == ("COMPLETED", "1"), (record, story)
  saved = _saved_steps(output)
  assert len(saved) == 1 and saved[0] >= 3, story
  saved = saved[0]
  lines = [line for line in output.splitlines() if line.startswith("launch.slurm:")]
  assert lines == [
      "launch.slurm: received SIGTERM at the time limit; the training tasks save their "
      "current step",
      f"launch.slurm: preempted (SIGTERM at the time limit); the run saved step {saved}; "
      f"requeueing job {job} (restart 1 of 5)"], story
  resumed = [int(s) for s in re.findall(r"Resuming from the checkpoint of step (\d+)", output)]
  assert resumed == [saved], story
  losses = _train_rows(workdir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  assert all(rows == [one_task_reference[step]] for step, rows in losses.items()), losses
  restart_rows = [row for row in read_metrics(workdir) if row.get("kind") == "restart"]
  assert [(row["step"], row["lost_steps"]) for row in restart_rows] == [(saved, 0)], (
      restart_rows)


@pytest.mark.soak   # 4 tasks on 2 nodes and the 4-process reference: about 3 minutes
def test_a_lost_node_requeues_the_job_from_the_newest_checkpoint(
    cluster, run_env, reference, tmp_path):
  """node2 lost mid-run: every process in its namespace (its slurmd, the step's
  slurmstepd and tasks) killed at once, as a power cut, and the node marked DOWN, which
  slurmctld does itself once the node has not answered for SlurmdTimeout (300 s by
  default). slurmctld requeues the job itself (NODE_FAIL) and ends it on node1: the
  batch shell's SIGTERM finds the restart count grown, so the shell does not requeue it
  again; node1's tasks cannot agree on a step with the dead ones and abort, so nothing
  is saved. The job waits for two nodes, and once node2 is back it resumes from its
  newest checkpoint, a periodic one: the steps since it are trained again, with the
  reference's losses."""
  job, _, workdir = _submit_readme_example(run_env, tmp_path)
  _wait_for_step(cluster, job, workdir, tmp_path, 5)
  newest = _wait_for_checkpoint(workdir)   # step 4's save may still be in flight
  node2 = cluster.namespace("n2")
  try:
    pids = subprocess.run(["ip", "netns", "pids", node2], capture_output=True, text=True,
                          check=True).stdout.split()
    _signal_all([int(pid) for pid in pids], signal.SIGKILL)
    cluster.client("scontrol", "update", "NodeName=node2", "State=DOWN",
                   "Reason=lost-by-test")
    _wait_for_restart(cluster, job, 1, timeout_s=120)
  finally:
    cluster._start_in(node2, "node2", ["slurmd", "-f", cluster.conf, "-N", "node2"])  # pylint: disable=protected-access
    cluster.client("scontrol", "update", "NodeName=node2", "State=RESUME", check=False)
  record = cluster.wait_for(job, ["COMPLETED", "FAILED", "CANCELLED"], timeout_s=300)
  output = _output(tmp_path, job)
  story = _story(output)
  assert (record["JobState"], record["Restarts"]) == ("COMPLETED", "1"), (record, story)
  assert "DUE TO NODE FAILURE" in output, story
  assert [line for line in output.splitlines() if line.startswith("launch.slurm:")][0] == (
      f"launch.slurm: received SIGTERM: job {job} was requeued by SLURM (a preemption "
      "whose grace time ran out, or a node failed); the training tasks save their current "
      "step if they can"), story
  assert not _saved_steps(output) and "Preempted:" not in output, story
  resumed = [int(s) for s in re.findall(r"Resuming from the checkpoint of step (\d+)", output)]
  assert len(resumed) == 1 and resumed[0] >= newest >= 4 and resumed[0] % 4 == 0, story
  losses = _train_rows(workdir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  for step, rows in losses.items():
    assert all(loss == reference[step] for loss in rows), (step, rows, reference[step])
  restart_rows = [row for row in read_metrics(workdir) if row.get("kind") == "restart"]
  assert [row["step"] for row in restart_rows] == resumed, restart_rows
  assert restart_rows[0]["lost_steps"] >= 1, restart_rows   # trained again: lost


@pytest.mark.parametrize("flags, user, message", [
    (["--partition=nosuch"], "root", "Invalid partition name specified"),
    (["--partition=restricted"], "nobody",
     "User's group not permitted to use this partition")],
    ids=["no such partition", "no permission"])
def test_a_refused_submission_is_sbatchs_message_and_one_line(cluster, run_env, tmp_path,
                                                              flags, user, message):
  """sbatch refusing a job (a partition that does not exist; a user whose group the
  partition does not admit, as a site refuses a user without permission) prints its
  own message and exits non-zero; `launch.slurm` adds one line naming sbatch and its
  exit code, exits 1, and nothing is queued."""
  env = dict(run_env)
  if user == "nobody":
    env["PATH"] = cluster.unprivileged_bin + os.pathsep + env["PATH"]
  result = subprocess.run(
      [sys.executable, "-m", "launch.slurm", "--nodes=1", "--gpus_per_node=1",
       "--cpus_per_task=1", *flags, f"--output={tmp_path}/slurm-%j.out", "--", "true"],
      env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
  assert result.returncode == 1, (result.returncode, result.stderr)
  assert not result.stdout.strip(), result.stdout
  lines = result.stderr.splitlines()
  assert len(lines) >= 2 and lines[-1] == (
      "error: sbatch exited with code 1 (its message is above)"), result.stderr
  assert any(line.startswith("sbatch: error: ") and message in line
             for line in lines[:-1]), result.stderr
  assert not cluster.client("squeue", "--noheader").strip()
  if user == "nobody":   # the partition takes root's job: the refusal was the user's
    cluster.client("sbatch", "--test-only", *flags, "--wrap=true")


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


# A forked (WSD) study of one tiny Hawk: a stable run and two cool-down forks from it.
STUDY = ["--design=wsd", "--families=hawk", "--sizes=20k",
         "--cooldown_tokens_per_param=0.25,0.5", "--vocab_size=259", "--batch_size=2",
         "--sequence_length=32", "--gin_file=configs/base/trainer.gin",
         "--gin_file=configs/data/text_files.gin",
         "--gin_param=text_files_task.validation_fraction=0.5", "--gin_param=EVAL_EVERY=0",
         "--gin_param=TrainConfig.eval_batches=1", "--gin_param=LOG_EVERY=1",
         "--gin_param=CHECKPOINT_EVERY=8"]


def _wait_until_queue_empty(cluster, timeout_s=300):
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if not cluster.client("squeue", "-h").strip():
      return
    time.sleep(1)
  raise AssertionError(f"jobs still queued after {timeout_s} s:\n"
                       + cluster.client("squeue"))


@pytest.mark.soak   # a study of SLURM jobs: about 2 minutes
def test_sweep_runs_a_forked_study_as_slurm_jobs_retries_a_killed_run_and_fits(
    cluster, trainer_env, tmp_path):
  """`launch.sweep --backend=slurm`: each call submits what can run (the forks only once
  their stable run has finished), a run whose job was cancelled while queued counts as
  failed (squeue) and is submitted again, a fork killed mid-way is submitted again and
  resumes, and the last call collects every run and fits them."""
  study = tmp_path / "study"
  env = cluster.env(trainer_env.env)
  env.pop("XLA_FLAGS", None)   # each run is one single-device process
  args = [sys.executable, "-m", "launch.sweep", f"--workdir={study}", "--backend=slurm",
          "--nodes=1", "--gpus_per_node=1", "--cpus_per_task=1", "--partition=gpu",
          *STUDY, f"--gin_param=TRAIN_FILES='{trainer_env.corpus}/*.txt'"]

  def sweep():
    result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert_ok(result)
    return result.stdout

  nodes = f"NodeName=node[1-{NODES}]"
  cluster.client("scontrol", "update", nodes, "State=DRAIN", "Reason=held-by-test")
  try:
    queued = sweep()
    array_id = re.search(r"Submitted batch job (\d+)", queued).group(1)
    cluster.client("scancel", array_id)   # cancelled before launch.sweep_job ever ran
    _wait_until_queue_empty(cluster)
  finally:
    cluster.client("scontrol", "update", nodes, "State=RESUME")
  first = sweep()
  assert (f"[sweep] hawk_20k_stable: failed (slurm job {array_id}_0 ended without "
          "recording how it ended") in first, first
  assert "[sweep] submitted 1 run(s) to slurm" in first, first
  assert "fork(s) wait for their stable runs" in first, first
  _wait_until_queue_empty(cluster)
  second = sweep()
  assert "[sweep] hawk_20k_stable: finished" in second, second
  assert "[sweep] submitted 2 run(s) to slurm" in second, second
  forks = sorted(path.parent for path in study.glob("runs/*/sweep_status.json")
                 if path.parent.name != "hawk_20k_stable")
  assert len(forks) == 2, forks
  victim = forks[-1]
  _wait_for_step_of(victim, 10)
  pid = _trainer_pid([cluster.namespace(f"n{i + 1}") for i in range(NODES)],
                     f"--workdir={victim}")
  assert pid, f"no training process of {victim}"
  os.kill(pid, signal.SIGKILL)
  _wait_until_queue_empty(cluster)
  third = sweep()
  assert f"[sweep] {victim.name}: interrupted" in third, third
  assert "[sweep] submitted 1 run(s) to slurm" in third, third
  _wait_until_queue_empty(cluster)
  last = sweep()
  with open(study / "sweep.csv", encoding="utf-8") as f:
    rows = {row["run"]: row for row in csv.DictReader(f)}
  assert sorted(rows) == ["hawk_20k_stable", *(fork.name for fork in forks)], (rows, last)
  assert [rows[fork.name]["role"] for fork in forks] == ["fork", "fork"], rows
  assert all(float(row["loss"]) > 0 for row in rows.values())
  fit = json.loads((study / "fit.json").read_text())
  assert fit["hawk"]["n_points"] == 2, fit
  restarts = [row for row in read_metrics(str(victim)) if row.get("kind") == "restart"]
  assert len(restarts) == 1 and restarts[0]["step"] >= 0, restarts


def _wait_for_step_of(workdir, step, timeout_s=240):
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    steps = [row["step"] for row in read_metrics(str(workdir)) if "loss" in row]
    if steps and max(steps) >= step:
      return
    time.sleep(0.5)
  raise AssertionError(f"{workdir}: step {step} not reached in {timeout_s} s")
