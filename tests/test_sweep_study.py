"""launch.sweep studies: the isoFLOP design, cluster job specs (checked as the launcher
tests check them), run states read from run directories, and a local parallel study
killed midway and resumed."""
import csv
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from launch.dispatch import sweep_dispatch
from launch.dispatch import sweep_job
from launch.sweeps import sweep_design
from launch.sweeps import sweep_local
from pretrain.observability import flops as flops_lib
from tiers import slow_after_first

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGETS = (1e15, 3e15, 1e16)


def test_isoflop_plan_spends_each_budget_with_sizes_around_the_optimum(tmp_path):
  runs = sweep_design.plan_isoflop(["hawk", "mqa"], BUDGETS, points_per_budget=5, spread=3.0,
                            tokens_per_param=20, batch_size=8, sequence_length=128,
                            vocab_size=259, workdir=str(tmp_path))
  for family in ("hawk", "mqa"):
    for budget in BUDGETS:
      members = [r for r in runs if r.family == family and r.flop_budget == budget]
      assert 4 <= len(members) <= 5
      optimum = (budget / 120) ** 0.5
      counts = sorted(sweep_design.non_embedding_params(r.config) for r in members)
      assert counts[0] < optimum < counts[-1]
      assert counts[-1] / counts[0] > 4           # spread over ~9x (3x each way)
      for run in members:                          # the MFU FLOPs function, whole steps
        per_step = flops_lib.training_flops_per_token(run.config, 128) * 8 * 128
        assert abs(run.flops - budget) <= per_step / 2
        assert run.name == f"{family}_C{sweep_design.budget_label(budget)}_{run.size}"
  assert len({r.workdir for r in runs}) == len(runs)


def test_budget_labels():
  assert [sweep_design.budget_label(b) for b in (1e15, 3e15, 2.5e16, 100.0)] == [
      "1e15", "3e15", "2.5e16", "100e0"]


README_STUDY = ("python -m launch.sweep --families=griffin,hawk,mqa "
                "--flop_budgets=1e15,3e15,1e16 --points_per_budget=5")


def _study(tmp_path, *flags):
  """The README's isoFLOP command (default data config: the vocabulary from its Gin
  file), as a dry run with `flags`; returns stdout and the number of planned runs."""
  args = [sys.executable] + shlex.split(README_STUDY)[1:] + [
      f"--workdir={tmp_path}/study", "--dry_run", *flags]
  result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=180)
  assert result.returncode == 0, result.stderr
  assert not (tmp_path / "study").exists()
  runs = [l for l in result.stdout.splitlines() if l.startswith("| ") and "FLOPs" not in l
          and "---" not in l]
  assert 36 <= len(runs) <= 45 and {r.split(" | ")[0][2:] for r in runs} == {
      "griffin", "hawk", "mqa"}
  return result.stdout, len(runs)


@pytest.mark.slow  # a subprocess; its path is covered fast by a sibling test
def test_readme_isoflop_study_local_dry_run(tmp_path):
  out, count = _study(tmp_path)
  commands = [shlex.split(l) for l in out.splitlines() if "-m pretrain.train" in l]
  assert len(commands) == count
  for argv in commands:
    train = argv[argv.index("--") + 1:]
    assert train[1:3] == ["-m", "pretrain.train"]
    assert "--gin_file=configs/quickstart.gin" in train
    assert "--gin_param=ModelConfig.vocab_size = 259" in train
    assert "--gin_param=TrainConfig.final_eval = True" in train
    # The study is one group in the experiment trackers (a W&B group, an MLflow
    # experiment), named after its directory.
    assert "--gin_param=TrainConfig.tracker_group = 'study'" in train


@pytest.mark.slow
def test_slurm_dry_run_is_one_job_array_of_every_run(tmp_path):
  out, count = _study(tmp_path, "--backend=slurm", "--partition=gpu", "--time=02:00:00",
               "--nodes=1", "--gpus_per_node=4", "--setup=source ~/venv/bin/activate")
  script = out[out.index("#!/bin/bash"):]
  lines = script.splitlines()
  directives = [l.split(" ", 1)[1] for l in lines if l.startswith("#SBATCH")]
  for expected in (f"--array=0-{count - 1}", "--nodes=1", "--ntasks-per-node=4", "--gpus-per-node=4",
                   "--partition=gpu", "--time=02:00:00"):
    assert expected in directives
  assert "source ~/venv/bin/activate" in lines
  srun = shlex.split(next(l for l in lines if l.startswith("srun ")))
  assert srun[:4] == ["srun", "--kill-on-bad-exit=1", "bash", "-c"]
  selector = srun[4]
  cases = selector.split(" ;; ")
  assert len(cases) == count + 2 and cases[0].startswith('case "$SLURM_ARRAY_TASK_ID" in 0) exec ')
  first = shlex.split(cases[0].split(" exec ", 1)[1])
  assert first[:3] == ["python", "-m", "launch.sweep_job"]
  assert first[first.index("--") + 1:][:3] == ["python", "-m", "pretrain.train"]
  assert f"--workdir={tmp_path}/study/runs/griffin_C1e15_" in " ".join(first)
  assert first[first.index("--") + 1] == "python"   # the nodes' python, not this one's
  assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.mark.slow
def test_gke_dry_run_is_one_jobset_per_run(tmp_path):
  out, count = _study(tmp_path, "--backend=gke", "--image=img:1", "--tpu_type=v5p-8",
               "--env=WANDB_MODE=offline")
  manifests = [m for m in yaml.safe_load_all(out[out.index("apiVersion"):]) if m]
  assert len(manifests) == count
  names = [m["metadata"]["name"] for m in manifests]
  assert len(set(names)) == count and all(len(n) <= 63 for n in names)
  for manifest in manifests:
    assert manifest["kind"] == "JobSet"
    (job,) = manifest["spec"]["replicatedJobs"]
    pod = job["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x2x1"
    assert container["image"] == "img:1"
    assert container["command"][:3] == ["python", "-m", "launch.sweep_job"]
    assert "pretrain.train" in container["command"]
    assert container["env"] == [{"name": "WANDB_MODE", "value": "offline"}]


@pytest.mark.slow
def test_tpu_vm_dry_run_is_one_queued_resource_per_run(tmp_path):
  out, count = _study(tmp_path, "--backend=tpu_vm", "--tpu_type=v5p-8", "--zone=us-east5-a",
               "--project=proj", "--setup=source ~/venv/bin/activate")
  start = out.index("gcloud ")
  commands = [shlex.split(c) for c in re.split(r"\n(?=gcloud )", out[start:].strip())]
  assert len(commands) == count
  for argv in commands:
    assert argv[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", argv[5]]
    assert f"--node-id={argv[5]}" in argv and "--accelerator-type=v5p-8" in argv
    assert "--zone=us-east5-a" in argv and "--project=proj" in argv
    script = next(a for a in argv if a.startswith("--metadata=startup-script="))
    body = script.split("=", 2)[2]
    assert body.startswith("#!/bin/bash\ncd griffin-pretrain && source ~/venv/bin/activate && ")
    remote = shlex.split(body.splitlines()[1].split(" && ")[2])
    assert remote[:4] == ["exec", "python", "-m", "launch.sweep_job"]   # SIGTERM reaches it


@pytest.mark.parametrize("flags, fragment", slow_after_first([
    (["--backend=gke"], "--backend=gke needs --image and --tpu_type"),
    (["--backend=tpu_vm", "--tpu_type=v5p-8"], "needs --zone"),
    (["--flop_budgets=1e15,lots"], "--flop_budgets: 'lots'"),
]))
def test_bad_study_flags_are_one_line_and_exit_code_2(tmp_path, flags, fragment):
  result = subprocess.run(
      [sys.executable, "-m", "launch.sweep", "--families=hawk", "--vocab_size=259",
       f"--workdir={tmp_path}", "--dry_run", *flags], cwd=REPO, capture_output=True,
      text=True, timeout=120)
  assert result.returncode == 2, (result.stdout, result.stderr)
  errors = [l for l in result.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1 and fragment in errors[0], result.stderr


def test_run_states_come_from_the_run_directory(tmp_path):
  run_dir = str(tmp_path / "run")
  assert sweep_dispatch.run_state(run_dir, False) == ("pending", 0)
  sweep_job.write_status(run_dir, {"state": "running", "host": socket.gethostname(),
                                   "pid": os.getpid(), "failures": 0})
  assert sweep_dispatch.run_state(run_dir, False) == ("running", 0)
  dead = subprocess.Popen(["true"])
  dead.wait()
  sweep_job.write_status(run_dir, {"state": "running", "host": socket.gethostname(),
                                   "pid": dead.pid, "failures": 1})
  assert sweep_dispatch.run_state(run_dir, False) == ("interrupted", 1)
  sweep_job.write_status(run_dir, {"state": "running", "host": "another-node", "pid": 1})
  assert sweep_dispatch.run_state(run_dir, False)[0] == "running"
  sweep_job.write_status(run_dir, {"state": "submitted", "failures": 2})
  assert sweep_dispatch.run_state(run_dir, False) == ("running", 2)
  assert sweep_dispatch.run_state(run_dir, True) == ("finished", 2)


@pytest.mark.parametrize("code, state, failures", [(0, "interrupted", 0), (3, "failed", 1),
                                                   (-15, "interrupted", 0)])
def test_sweep_job_records_how_the_command_ended(tmp_path, code, state, failures):
  run_dir = str(tmp_path / "run")
  program = f"import os, signal; os.kill(os.getpid(), {-code}) if {code} < 0 else exit({code})"
  assert sweep_job.run([sys.executable, "-c", program], run_dir) == code
  status = sweep_job.read_status(run_dir)
  assert status["state"] == "exited" and status["exit_code"] == code
  assert sweep_dispatch.run_state(run_dir, False) == (state, failures)


@pytest.mark.slow   # fast tier under 5 min: a local study of subprocess runs (6-10 s)
def test_local_backend_retries_failures_up_to_max_retries(tmp_path):
  """A job failing every time runs 1 + max_retries times; a good one once."""
  bad = sweep_dispatch.Job("bad", str(tmp_path / "bad"),
                           [sys.executable, "-c", "print('boom'); exit(3)"])
  good = sweep_dispatch.Job("good", str(tmp_path / "good"), [
      sys.executable, "-c", f"open({str(tmp_path / 'good' / 'done')!r}, 'w').write('1')"])
  given_up = sweep_local.run_local(
      [bad, good], parallel=2, max_retries=2,
      is_finished=lambda job: os.path.exists(os.path.join(job.run_dir, "done")),
      log=lambda _: None)
  assert given_up == ["bad"]
  assert sweep_job.read_status(bad.run_dir)["failures"] == 3
  assert (tmp_path / "bad" / "sweep_train.log").read_text().count("boom") == 3
  assert sweep_job.read_status(good.run_dir)["failures"] == 0


@pytest.mark.slow   # fast tier under 5 min: a local study of subprocess runs (6-10 s)
def test_local_backend_gives_up_on_runs_that_end_unfinished(tmp_path):
  """Exit 0 without the final evaluation (e.g. no validation split) is not retried forever."""
  job = sweep_dispatch.Job("quiet", str(tmp_path / "quiet"), [sys.executable, "-c", "pass"])
  assert sweep_local.run_local([job], parallel=1, max_retries=1,
                                  is_finished=lambda _: False, log=lambda _: None) == ["quiet"]


def test_dns_names_keep_the_attempt_suffix():
  name = sweep_dispatch.dns_name("Study_X" * 10, "griffin_C1e15_962k", suffix="a1795428729")
  assert len(name) <= 63 and name.endswith("-a1795428729")
  assert re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", name)


@pytest.mark.slow
@pytest.mark.soak   # about 2 minutes; the toy sweep's kill and resume stays in CI (test_sweep)
def test_local_parallel_isoflop_study_is_killed_and_resumed(tmp_path):
  """Griffin, Hawk and MQA on an isoFLOP design with a tiny budget, 2 runs at a time:
  the sweep is SIGKILLed once a run has finished (its other run keeps training,
  orphaned), then resumed: the finished run is not redone, the orphan is waited for,
  the rest complete. (The budgets are so small that every size maps to the smallest
  model of each family: this checks the machinery, not a fit; the analysis of a study
  directory is tested in test_scaling_fit.)"""
  workdir = tmp_path / "study"
  env = dict(os.environ, GRIFFIN_DATA_CACHE=str(tmp_path / "cache"))
  env.pop("XLA_FLAGS", None)
  args = [sys.executable, "-m", "launch.sweep", "--families=griffin,hawk,mqa",
          "--flop_budgets=2e9", "--points_per_budget=3", "--isoflop_spread=2",
          "--tokens_per_param=4", f"--workdir={workdir}", "--vocab_size=259",
          "--batch_size=2", "--sequence_length=32", "--parallel=2",
          "--gin_file=configs/base/trainer.gin", "--gin_file=configs/data/text_files.gin",
          "--gin_param=TRAIN_FILES='{stdlib}/json/*.py'",
          "--gin_param=text_files_task.validation_fraction=0.5",
          "--gin_param=EVAL_EVERY=0", "--gin_param=TrainConfig.eval_batches=1"]
  first = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
  finished_before = []
  deadline = time.monotonic() + 500
  for line in first.stdout:                         # kill once a run has finished
    if line.rstrip().endswith(": finished"):
      finished_before.append(line.split()[1].rstrip(":"))
      break
    assert time.monotonic() < deadline
  os.killpg(first.pid, signal.SIGKILL)
  first.wait()
  stamps = {name: (workdir / "runs" / name / "metrics.jsonl").stat().st_mtime_ns
            for name in finished_before}
  second = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
  assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
  for name in finished_before:
    assert f"[sweep] {name}: finished (eval loss" in second.stdout
    assert (workdir / "runs" / name / "metrics.jsonl").stat().st_mtime_ns == stamps[name]
  with open(workdir / "sweep.csv") as f:
    rows = list(csv.DictReader(f))
  assert {r["family"] for r in rows} == {"griffin", "hawk", "mqa"}
  assert all(float(r["loss"]) > 0 for r in rows)
  for row in rows:                                  # each run spent its budget
    assert float(row["flops"]) == pytest.approx(float(row["flop_budget"]),
                                                rel=0.5 * float(row["flops_per_token"])
                                                * 64 / float(row["flop_budget"]) + 1e-9)


@pytest.mark.slow   # fast tier under 5 min: a local study of subprocess runs (6-10 s)
def test_local_backend_gives_up_on_runs_that_never_record_their_status(tmp_path, monkeypatch):
  """A launch.sweep_job that records nothing (here: the environment names it process 1,
  which leaves the status to process 0) is started 1 + max_retries times, not forever."""
  monkeypatch.setenv("SLURM_PROCID", "1")
  job = sweep_dispatch.Job("mute", str(tmp_path / "mute"),
                           [sys.executable, "-c", "print('boom'); exit(3)"])
  assert sweep_local.run_local([job], parallel=1, max_retries=1,
                               is_finished=lambda _: False, log=lambda _: None) == ["mute"]
  assert (tmp_path / "mute" / "sweep_train.log").read_text().count("boom") == 2
  assert sweep_job.read_status(job.run_dir) is None
