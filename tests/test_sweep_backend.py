"""A launcher backend is a plug-in: `ToyBackend`, defined and registered from this file
alone, gets its own `launch.sweep` flag and runs a study end to end (it "submits" a job
by running it here, through `launch.sweep_job` like every backend)."""
import csv
import dataclasses
import os
import shlex
import subprocess
import sys
from typing import List, Sequence

from absl import flags
import pytest

from launch.dispatch import sweep_dispatch
from launch.dispatch import sweep_job
from launch.sweeps import sweep_design
from launch.sweeps import sweep_execute

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class ToyBackend:
  """Runs each ready job to its end, one after another, and notes it with `marker`
  (its `--toy_marker` flag) in the study's `toy.log`."""
  marker: str = ""

  name = "toy"
  here = True

  def define_flags(self) -> None:
    flags.DEFINE_string("toy_marker", self.marker, "toy: a word written per job.")

  def from_flags(self, values: flags.FlagValues) -> "ToyBackend":
    sweep_dispatch.require_flags(values, self.name, ("toy_marker",))
    return dataclasses.replace(self, marker=values.toy_marker)

  def dispatch(self, jobs: Sequence[sweep_dispatch.Job],
               study: sweep_dispatch.Study) -> List[str]:
    if study.dry_run:
      for job in jobs:
        print(f"toy {self.marker}: {shlex.join(job.wrapped())}")
      return []
    os.makedirs(study.directory, exist_ok=True)
    for job in jobs:
      if study.ready(job):
        with open(os.path.join(study.directory, "toy.log"), "a", encoding="utf-8") as log:
          log.write(f"{self.marker} {job.name}\n")
        sweep_job.run(job.command, job.run_dir)
    return [job.name for job in jobs if not study.is_finished(job)]


@pytest.fixture
def toy():
  backend = sweep_dispatch.register(ToyBackend(marker="m"))
  yield backend
  sweep_dispatch.unregister(backend.name)


def test_a_registered_backend_is_looked_up_by_name_and_dispatches_the_study(toy, tmp_path,
                                                                            capsys):
  assert sweep_dispatch.names()[-1] == "toy" and sweep_dispatch.get("toy") is toy
  with pytest.raises(ValueError, match="registered already"):
    sweep_dispatch.register(ToyBackend(marker="other"))
  runs = sweep_design.plan(["hawk", "mqa"], ["0.2m"], tokens_per_param=20, batch_size=4,
                           sequence_length=32, vocab_size=18, workdir=str(tmp_path))
  states = sweep_execute.execute(runs, ["configs/quickstart.gin"], [], toy,
                                 study_dir=str(tmp_path), dry_run=True,
                                 log=lambda _: None)
  assert states == {"hawk_0.2m": "pending", "mqa_0.2m": "pending"}
  lines = capsys.readouterr().out.splitlines()
  argvs = [shlex.split(line) for line in lines]
  assert [argv[:6] for argv in argvs] == [
      ["toy", "m:", "python", "-m", "launch.sweep_job", f"--run_dir={run.workdir}"]
      for run in runs]
  # A backend that runs jobs here gets commands that name this interpreter.
  assert all(argv[argv.index("--") + 1:][:3] == [sys.executable, "-m", "pretrain.train"]
             for argv in argvs)


def test_an_unregistered_backend_is_an_error_naming_the_registered_ones():
  with pytest.raises(ValueError, match=r"unknown backend 'nope'; expected one of "
                     r"\['local', 'slurm', 'gke', 'tpu_vm'"):
    sweep_dispatch.get("nope")


# `launch.sweep` as a user runs it, with the toy backend registered first.
_SWEEP_WITH_TOY = f"""
import sys
sys.path.insert(0, {TESTS!r})
from launch import sweep
from launch.dispatch import sweep_dispatch
from plumbing import cli
import test_sweep_backend
sweep_dispatch.register(test_sweep_backend.ToyBackend())
sweep.define_flags()
cli.run(sweep.main)
"""


def _sweep_with_toy(workdir, *flags_, env=None):
  return subprocess.run(
      [sys.executable, "-c", _SWEEP_WITH_TOY, "--families=hawk", "--sizes=30k",
       f"--workdir={workdir}", "--vocab_size=259", "--batch_size=2",
       "--sequence_length=32", "--max_steps=2", "--backend=toy",
       "--gin_file=configs/base/trainer.gin", "--gin_file=configs/data/text_files.gin",
       "--gin_param=TRAIN_FILES='{stdlib}/json/*.py'",
       "--gin_param=text_files_task.validation_fraction=0.5",
       "--gin_param=EVAL_EVERY=0", "--gin_param=TrainConfig.eval_batches=1", *flags_],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_the_backends_own_flag_is_checked_like_a_builtin_ones(tmp_path):
  result = _sweep_with_toy(tmp_path, "--dry_run")
  assert result.returncode == 2, (result.stdout, result.stderr)
  assert result.stderr.strip() == "error: --backend=toy needs --toy_marker"


@pytest.mark.slow  # one real (2-step) training run
def test_a_study_runs_end_to_end_through_a_registered_backend(tmp_path):
  env = dict(os.environ, GRIFFIN_DATA_CACHE=str(tmp_path / "cache"))
  env.pop("XLA_FLAGS", None)  # one ordinary single-device process
  workdir = tmp_path / "study"
  result = _sweep_with_toy(workdir, "--toy_marker=hello", env=env)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert (workdir / "toy.log").read_text() == "hello hawk_30k\n"
  with open(workdir / "sweep.csv") as f:
    (row,) = list(csv.DictReader(f))
  assert row["run"] == "hawk_30k" and 0 < float(row["loss"]) < 10
  assert sweep_job.read_status(str(workdir / "runs" / "hawk_30k"))["exit_code"] == 0
  again = _sweep_with_toy(workdir, "--toy_marker=hello", env=env)   # nothing left to do
  assert again.returncode == 0 and "hawk_30k: finished (eval loss" in again.stdout
  assert (workdir / "toy.log").read_text() == "hello hawk_30k\n"
