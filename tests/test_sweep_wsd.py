"""The forked (WSD) design of launch.sweep: the plan's fork steps and costs, the fork's
start from its stable checkpoint (launch.fork), dispatch that waits for the stable run,
cluster specs, and a tiny study end to end, killed and resumed, whose fork matches an
unforked run step for step."""
import csv
import dataclasses
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import yaml

from launch.dispatch import sweep_dispatch
from launch.dispatch import sweep_job
from launch.sweeps import fork as fork_lib
from launch.sweeps import ladder
from launch.sweeps import size_rule
from launch.sweeps import sweep_design
from launch.sweeps import sweep_execute
from launch.sweeps import sweep_local
from launch.sweeps import wsd_design
from plumbing.errors import UserError
from pretrain import optimizer as optimizer_lib
from pretrain.checkpoints.integrity import COMMIT_MARKER
from tiers import slow_after_first

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS = wsd_design.WsdOptions((5.0, 10.0, 20.0, 40.0), 0.2, "1-sqrt")


def _plan(tmp_path, families=("hawk", "mqa"), sizes=("0.5m", "1m"), options=OPTIONS):
  base = sweep_design.plan(families, sizes, tokens_per_param=1, batch_size=8, sequence_length=128,
                    vocab_size=259, workdir=str(tmp_path), peak_learning_rate=1e-3)
  return wsd_design.plan_wsd(base, options, workdir=str(tmp_path))


def _bindings(run):
  lines = [l.split(" = ", 1) for l in sweep_design.run_bindings(run) if " = " in l]
  return {key: value for key, value in lines}


def test_each_fork_cools_down_from_a_checkpoint_its_stable_run_keeps(tmp_path):
  runs = _plan(tmp_path)
  stables = [r for r in runs if r.role == "stable"]
  assert len(stables) == 4 and len(runs) == 4 * 5
  for stable in stables:
    forks = [r for r in runs if r.source == stable.name]
    assert len(forks) == 4
    every = int(_bindings(stable)["CHECKPOINT_EVERY"])
    assert _bindings(stable)["CheckpointConfig.keep_every"] == str(every)
    assert _bindings(stable)["OptimizerConfig.cooldown_fraction"] == "0.0"
    argv = sweep_design.command(stable, ["configs/quickstart.gin"], ["CHECKPOINT_EVERY=1000"])
    assert argv[-3:-1] == [f"--gin_param=CHECKPOINT_EVERY = {every}",   # the user's lose
                           f"--gin_param=CheckpointConfig.keep_every = {every}"]
    assert argv[-4] == "--gin_param=CHECKPOINT_EVERY=1000"
    assert stable.train_steps == max(f.fork_step for f in forks)
    params = sweep_design.non_embedding_params(stable.config)
    for tokens, fork in zip(OPTIONS.cooldown_tokens_per_param, forks):
      config = optimizer_lib.OptimizerConfig(
          warmup_steps=fork.warmup_steps, schedule="wsd", cooldown_fraction=0.2)
      assert optimizer_lib.cooldown_start(config, fork.train_steps) == fork.fork_step
      assert fork.fork_step % every == 0
      assert fork.warmup_steps == stable.warmup_steps < fork.fork_step
      assert fork.peak_learning_rate == stable.peak_learning_rate == 1e-3
      assert fork.fork_from == stable.workdir and fork.config == stable.config
      assert fork.tokens == pytest.approx(tokens * params, rel=0.07)
      assert (fork.train_steps - fork.fork_step) / fork.train_steps == pytest.approx(0.2,
                                                                                     abs=0.01)
      assert _bindings(fork)["OptimizerConfig.schedule"] == "'wsd'"
      assert _bindings(fork)["OptimizerConfig.cooldown_shape"] == "'1-sqrt'"


def test_study_cost_counts_each_stable_prefix_once(tmp_path):
  runs = _plan(tmp_path)
  cost = wsd_design.study_cost(runs)
  stable = sum(r.flops for r in runs if r.role == "stable")
  cooldowns = sum(r.flops * (r.train_steps - r.fork_step) / r.train_steps
                  for r in runs if r.role == "fork")
  cosine = sum(r.flops for r in runs if r.role == "fork")
  assert cost["total"]["flops"] == pytest.approx(stable + cooldowns)
  assert cost["total"]["cosine_grid_flops"] == pytest.approx(cosine)
  # 0.8·40 stable + 0.2·(5+10+20+40) cooldown over 75 cosine: 47/75 ≈ 0.63.
  assert cost["total"]["ratio"] == pytest.approx(47 / 75, abs=0.03)
  assert set(cost) == {"hawk", "mqa", "total"}
  record = json.loads(wsd_design.design_json(runs, OPTIONS))
  assert record["forks"]["hawk_1m_wsd20"]["source"] == "hawk_1m_stable"


@pytest.mark.parametrize("bad, fragment", [
    (dict(cooldown_tokens_per_param=()), "positive token counts"),
    (dict(cooldown_fraction=1.0), "strictly between 0 and 1"),
    (dict(cooldown_shape="cosine"), "--cooldown_shape")])
def test_bad_design_options_name_the_flag(bad, fragment):
  args = dict(cooldown_tokens_per_param=(5.0,), cooldown_fraction=0.2)
  args.update(bad)
  with pytest.raises(ValueError, match=fragment):
    wsd_design.WsdOptions(**args)


def _checkpoint(run_dir, step):
  step_dir = os.path.join(run_dir, "checkpoints", str(step))
  os.makedirs(os.path.join(step_dir, "params"))
  with open(os.path.join(step_dir, "params", "data"), "w") as f:
    f.write(f"weights of step {step}")
  with open(os.path.join(step_dir, COMMIT_MARKER), "w") as f:
    f.write("ok")


def test_fork_copies_the_stable_checkpoint_once(tmp_path):
  stable, fork = str(tmp_path / "stable"), str(tmp_path / "fork")
  with pytest.raises(UserError, match="no committed checkpoint of step 8"):
    fork_lib.seed(stable, 8, fork)
  _checkpoint(stable, 4)
  _checkpoint(stable, 8)
  assert fork_lib.seed(stable, 8, fork)
  assert os.listdir(os.path.join(fork, "checkpoints")) == ["8"]
  with open(os.path.join(fork, "checkpoints", "8", "params", "data")) as f:
    assert f.read() == "weights of step 8"
  assert os.path.exists(os.path.join(fork, "checkpoints", "8", COMMIT_MARKER))
  assert not os.path.exists(os.path.join(fork, fork_lib.STAGING))
  assert not fork_lib.seed(stable, 4, fork)      # a resumed fork keeps its own state


@pytest.mark.slow   # fast tier under 5 min: real forked runs (8 s)
def test_local_dispatch_starts_a_fork_only_after_its_source(tmp_path):
  """The fork is first in the queue but waits for the stable job; a fork whose source
  gives up is never started."""
  done = lambda job: os.path.exists(os.path.join(job.run_dir, "done"))  # noqa: E731
  write = lambda d: [sys.executable, "-c",  # noqa: E731
                     f"import os; os.makedirs({d!r}, exist_ok=True); "
                     f"open(os.path.join({d!r}, 'done'), 'w').write('1')"]
  stable = sweep_dispatch.Job("stable", str(tmp_path / "stable"),
                              write(str(tmp_path / "stable")))
  fork = sweep_dispatch.Job("fork", str(tmp_path / "fork"),
                            write(str(tmp_path / "fork")))
  order = []
  ready = lambda job: job.name != "fork" or done(stable)  # noqa: E731
  given_up = sweep_local.run_local([fork, stable], parallel=2, max_retries=0,
                                      is_finished=done, log=order.append, ready=ready)
  assert given_up == []
  starts = [line for line in order if line.startswith("[sweep] start")]
  assert starts == ["[sweep] start stable", "[sweep] start fork"]
  bad = sweep_dispatch.Job("bad", str(tmp_path / "bad"), [sys.executable, "-c", "exit(3)"])
  orphan = sweep_dispatch.Job("orphan", str(tmp_path / "orphan"), write(str(tmp_path / "o")))
  lines = []
  given_up = sweep_local.run_local(
      [orphan, bad], parallel=1, max_retries=0, is_finished=done, log=lines.append,
      ready=lambda job: job.name != "orphan" or done(bad))
  assert given_up == ["bad", "orphan"]
  assert "[sweep] orphan: what it starts from never finished; not started" in lines


def _dry_run(tmp_path, capsys, backend, **options):
  runs = _plan(tmp_path, families=("hawk",), sizes=("0.5m",))
  sweep_execute.execute(runs, ["configs/quickstart.gin"], [],
                        dataclasses.replace(sweep_dispatch.get(backend), **options),
                        study_dir=str(tmp_path), dry_run=True, log=lambda _: None)
  out = capsys.readouterr().out
  first, later = out.split("# Submitted by a later run of this command")
  return runs, first, later


def _fork_argv(argv, runs):
  """The fork part of a wrapped command: launch.fork with its source, then training."""
  inner = argv[argv.index("--") + 1:]
  assert inner[:3] == ["python", "-m", "launch.fork"]
  workdir = next(a for a in inner if a.startswith("--workdir="))[len("--workdir="):]
  run = next(r for r in runs if r.workdir == workdir)
  assert f"--source={run.fork_from}" in inner and f"--step={run.fork_step}" in inner
  train = inner[inner.index("--") + 1:]
  assert train[:3] == ["python", "-m", "pretrain.train"]
  assert f"--gin_param=TrainConfig.train_steps = %TRAIN_STEPS" in train
  assert f"--gin_param=TRAIN_STEPS = {run.train_steps}" in train
  return run


def test_slurm_dry_run_submits_forks_after_their_stable_run(tmp_path, capsys):
  runs, first, later = _dry_run(tmp_path, capsys, "slurm", partition="gpu")
  assert "#SBATCH --array=0-0" in first and "launch.fork" not in first
  assert "hawk_0.5m_stable" in first
  script = later[later.index("#!/bin/bash"):]
  assert "#SBATCH --array=0-3" in script
  assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
  srun = shlex.split(next(l for l in script.splitlines() if l.startswith("srun ")))
  cases = srun[4].split(" ;; ")[:-2]
  forks = {_fork_argv(shlex.split(c.split(" exec ", 1)[1]), runs).name for c in cases}
  assert forks == {r.name for r in runs if r.role == "fork"}


def test_gke_and_tpu_vm_dry_runs_hold_forks_back(tmp_path, capsys):
  runs, first, later = _dry_run(tmp_path, capsys, "gke", image="img:1", tpu_type="v5p-8")
  assert len([m for m in yaml.safe_load_all(first[first.index("apiVersion"):]) if m]) == 1
  manifests = [m for m in yaml.safe_load_all(later[later.index("apiVersion"):]) if m]
  assert len(manifests) == 4
  for manifest in manifests:
    (job,) = manifest["spec"]["replicatedJobs"]
    (container,) = job["template"]["spec"]["template"]["spec"]["containers"]
    _fork_argv(container["command"], runs)
  runs, first, later = _dry_run(tmp_path, capsys, "tpu_vm", tpu_type="v5p-8",
                                zone="us-east5-a")
  assert first.count("gcloud compute tpus") == 1 and later.count("gcloud compute tpus") == 4
  commands = [shlex.split(c) for c in re.split(r"\n(?=gcloud )",
                                              later[later.index("gcloud "):].strip())]
  for argv in commands:
    script = next(a for a in argv if a.startswith("--metadata=startup-script="))
    remote = script.split("=", 2)[2].splitlines()[1]
    assert remote.startswith("cd griffin-pretrain && ")
    _fork_argv(shlex.split(remote.split(" && ", 1)[1]), runs)


STUDY = ["--design=wsd", "--families=hawk", "--sizes=20k",
         "--cooldown_tokens_per_param=0.05,0.1", "--vocab_size=259", "--batch_size=2",
         "--sequence_length=32", "--parallel=1", "--lr_sweep=1e-3,1e-2",
         "--lr_sweep_sizes=1", "--lr_sweep_tokens_per_param=0.05",
         "--gin_file=configs/base/trainer.gin", "--gin_file=configs/data/text_files.gin",
         "--gin_param=TRAIN_FILES='{stdlib}/json/*.py'",
         "--gin_param=text_files_task.validation_fraction=0.5", "--gin_param=EVAL_EVERY=0",
         "--gin_param=TrainConfig.eval_batches=1", "--gin_param=LOG_EVERY=1",
         "--gin_param=CHECKPOINT_EVERY=1000"]   # the stable run's own steps still win


def _bindings_of(run_dir):
  """The Gin bindings the run's command line gave it (from its config.gin)."""
  text = (run_dir / "config.gin").read_text()
  return dict(l.split(" = ", 1) for l in text.splitlines() if " = " in l)


def _losses(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return {r["step"]: (r["loss"], r["learning_rate"]) for r in rows if "loss" in r}


@pytest.mark.slow
@pytest.mark.soak   # about 3 minutes of local runs; forks' planning and dispatch: fast tests
def test_local_wsd_study_is_killed_and_resumed_and_forks_match_unforked_runs(tmp_path):
  """Hawk at its smallest size: two learning-rate probes, then a stable run and two
  forks at the rate of the rule fitted to the probes. The sweep is SIGKILLed as soon as
  the stable run has finished, then resumed: the stable run is not redone, the forks
  start from its checkpoints and finish; sweep.csv, design.json and the fit skip the
  stable run; size_rule.json records the rule the runs used. The longer fork's losses
  and learning rates equal, step for step, those of the same run trained from scratch
  without forking."""
  workdir = tmp_path / "study"
  env = dict(os.environ, GRIFFIN_DATA_CACHE=str(tmp_path / "cache"))
  env.pop("XLA_FLAGS", None)
  args = [sys.executable, "-m", "launch.sweep", f"--workdir={workdir}", *STUDY]
  first = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
  deadline = time.monotonic() + 400
  for line in first.stdout:
    if line.startswith("[sweep] hawk_20k_stable: finished"):
      break
    assert time.monotonic() < deadline
  os.killpg(first.pid, signal.SIGKILL)
  first.wait()
  stable_dir = workdir / "runs" / "hawk_20k_stable"
  stamp = (stable_dir / "metrics.jsonl").stat().st_mtime_ns
  second = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
  assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
  assert "[sweep] hawk_20k_stable: finished (eval loss" in second.stdout
  assert (stable_dir / "metrics.jsonl").stat().st_mtime_ns == stamp
  with open(workdir / "sweep.csv") as f:
    rows = {r["run"]: r for r in csv.DictReader(f)}
  assert {r["role"] for r in rows.values()} == {"stable", "fork"}
  assert all(float(r["loss"]) > 0 for r in rows.values())
  design = json.loads((workdir / "design.json").read_text())
  assert design["cost"]["total"]["ratio"] < 1
  fit = json.loads((workdir / "fit.json").read_text())
  assert fit["hawk"]["n_points"] == 2        # the two forks, not the stable run
  rule = json.loads((workdir / "size_rule.json").read_text())["families"]["hawk"]
  assert [p["rates"] for p in rule["sizes"]] == [[1e-3, 1e-2]] and rule["exponent"] == 0
  rate = rule["coefficient"]
  assert rate in (1e-3, 1e-2)       # two probes: the better one (not bracketed)
  assert _bindings_of(workdir / "runs" / "hawk_20k_stable")[
      "OptimizerConfig.peak_learning_rate"] == repr(rate)
  # The longer fork against the same run unforked.
  base = sweep_design.plan(["hawk"], ["20k"], tokens_per_param=1, batch_size=2,
                    sequence_length=32, vocab_size=259, workdir=str(workdir),
                    peak_learning_rate=rate)
  runs = wsd_design.plan_wsd(base, wsd_design.WsdOptions((0.05, 0.1), 0.2, "1-sqrt"),
                             workdir=str(workdir))
  fork = max((r for r in runs if r.role == "fork"), key=lambda r: r.train_steps)
  reference = str(tmp_path / "unforked")
  argv = sweep_design.command(dataclasses.replace(fork, fork_from=None, workdir=reference),
                       [a.split("=", 1)[1] for a in STUDY if a.startswith("--gin_file=")],
                       [a.split("=", 1)[1] for a in STUDY if a.startswith("--gin_param=")],
                       sys.executable)
  subprocess.run(argv, cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
  forked, unforked = _losses(fork.workdir), _losses(reference)
  after = [s for s in sorted(unforked) if s > fork.fork_step]
  assert after and sorted(forked) == after
  for step in after:
    assert forked[step] == pytest.approx(unforked[step], rel=1e-6), step


def test_best_rate_is_the_parabola_vertex_when_bracketed():
  rates = [1e-3, 3e-3, 1e-2, 3e-2]
  optimum = 5e-3
  losses = [2.0 + 0.1 * (math.log(r) - math.log(optimum)) ** 2 for r in rates]
  rate, bracketed = size_rule.best_rate(rates, losses)
  assert bracketed and rate == pytest.approx(optimum, rel=1e-6)
  assert size_rule.best_rate(rates, sorted(losses)) == (1e-3, False)   # still falling
  assert size_rule.best_rate([1e-3, 1e-2], [2.0, 1.9]) == (1e-2, False)


def test_rule_recovers_a_power_law_of_size_and_is_written_to_the_study():
  sizes = []
  for params in (3e4, 1e5, 3e5):
    optimum = 0.5 * params ** -0.4
    rates = [optimum * f for f in (0.25, 0.5, 1.0, 2.0, 4.0)]
    sizes.append((int(params), rates,
                  [3.0 + 0.05 * math.log(r / optimum) ** 2 for r in rates]))
  rule = size_rule.fit_rule("hawk", sizes)
  assert rule.exponent == pytest.approx(-0.4, abs=1e-6)
  assert rule(2e6) == pytest.approx(0.5 * 2e6 ** -0.4, rel=1e-5)
  record = json.loads(size_rule.rules_json({"hawk": rule}, [1e-3, 1e-2], 2, 20.0))
  assert record["families"]["hawk"]["exponent"] == pytest.approx(-0.4, abs=1e-6)
  assert len(record["families"]["hawk"]["sizes"]) == 3
  single = size_rule.fit_rule("mqa", sizes[:1])
  assert single.exponent == 0 and single(1e9) == pytest.approx(0.5 * 3e4 ** -0.4, rel=1e-5)


def test_probes_cover_the_smallest_sizes_at_every_rate(tmp_path):
  sizes = sweep_design.plan(["hawk", "mqa"], ["2m", "0.5m", "1m"], tokens_per_param=20,
                     batch_size=8, sequence_length=128, vocab_size=259,
                     workdir=str(tmp_path))
  probes = size_rule.plan_probes(sizes, [1e-3, 1e-2], count=2, workdir=str(tmp_path),
                                 extra_gin=("OptimizerConfig.schedule = 'wsd'",))
  assert sorted(p.name for p in probes if p.family == "hawk") == [
      "hawk_0.5m_lr0.001", "hawk_0.5m_lr0.01", "hawk_1m_lr0.001", "hawk_1m_lr0.01"]
  assert all(p.role == "lr_probe" and p.workdir.endswith(p.name) for p in probes)
  assert _bindings(probes[1])["OptimizerConfig.peak_learning_rate"] == "0.01"
  assert _bindings(probes[1])["OptimizerConfig.schedule"] == "'wsd'"


@pytest.mark.parametrize("rates, fragment", [(["1e-3", "fast"], "'fast' is not a positive"),
                                             (["1e-3"], "at least 2 distinct")])
def test_bad_lr_sweeps_name_the_flag(rates, fragment):
  with pytest.raises(ValueError, match=fragment):
    size_rule.parse_rates(rates)


def _synthetic_study(study):
  """A finished study's sweep.csv drawn from L = 1.5 + 40/N^0.3 + 40/D^0.3 (C = 6ND),
  whose compute-optimal N at C is sqrt(C/6): 35k parameters at 7.35e9 FLOPs."""
  study.mkdir()
  rows = ["run,family,params,tokens,flops,loss,role"]
  for budget in (1e8, 3e8, 1e9):
    for factor in (0.25, 0.5, 1.0, 2.0, 4.0):
      n = factor * math.sqrt(budget / 6)
      d = budget / (6 * n)
      loss = 1.5 + 40 / n ** 0.3 + 40 / d ** 0.3
      rows.append(f"r{budget:g}_{factor},hawk,{n:.1f},{d:.1f},{budget:g},{loss:.6f},fork")
  rows.append("stable,hawk,1000,1000,6e6,9.9,stable")    # skipped by the fit
  (study / "sweep.csv").write_text("\n".join(rows) + "\n")


LADDER = ["--families=hawk", "--train_optimum=7.35e9", "--replicates=20",
          "--batch_size=4", "--sequence_length=32", "--vocab_size=259",
          "--gin_file=configs/base/trainer.gin", "--gin_file=configs/data/text_files.gin",
          "--gin_param=TRAIN_FILES='{stdlib}/json/*.py'",
          "--gin_param=text_files_task.validation_fraction=0.5", "--gin_param=EVAL_EVERY=0",
          "--gin_param=TrainConfig.eval_batches=1"]


def test_ladder_dry_run_plans_the_fitted_optimum_and_writes_nothing(tmp_path):
  study = tmp_path / "study"
  _synthetic_study(study)
  result = subprocess.run([sys.executable, "-m", "launch.sweep", f"--workdir={study}",
                           "--dry_run", *LADDER], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  line = next(l for l in result.stdout.splitlines() if l.startswith("[ladder] hawk_optimum"))
  assert "forecast loss" in line
  assert "launch.sweep_job" in result.stdout and "hawk_optimum_C7.35e9" in result.stdout
  assert not (study / "ladder").exists()


@pytest.mark.slow
def test_ladder_trains_the_optimum_and_scores_the_forecast_made_before(tmp_path):
  study = tmp_path / "study"
  _synthetic_study(study)
  env = dict(os.environ, GRIFFIN_DATA_CACHE=str(tmp_path / "cache"))
  env.pop("XLA_FLAGS", None)   # one CPU device, as a user runs it
  args = [sys.executable, "-m", "launch.sweep", f"--workdir={study}", *LADDER]
  result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  run_dir = study / "ladder" / "hawk_optimum_C7.35e9"
  forecast = json.loads((run_dir / "forecast.json").read_text())
  predicted = forecast["predicted"]
  assert forecast["n_opt"]["value"] == pytest.approx(math.sqrt(7.35e9 / 6), rel=0.05)
  assert predicted["low"] <= predicted["value"] <= predicted["high"]
  assert forecast["error"] == pytest.approx(forecast["measured"] - predicted["value"])
  assert f"[ladder] hawk_optimum_C7.35e9: forecast {predicted['value']:.4f}" in result.stdout
  assert "measured" in result.stdout and "the interval" in result.stdout
  stamp = (run_dir / "metrics.jsonl").stat().st_mtime_ns
  again = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
  assert again.returncode == 0
  assert (run_dir / "metrics.jsonl").stat().st_mtime_ns == stamp     # not retrained
  assert json.loads((run_dir / "forecast.json").read_text())["predicted"] == predicted


@pytest.mark.parametrize("flags, fragment", slow_after_first([
    (["--cooldown_tokens_per_param=5,lots"], "--cooldown_tokens_per_param: not a number"),
    (["--flop_budgets=1e15"], "drop --flop_budgets"),
    (["--cooldown_fraction=1"], "--cooldown_fraction must lie strictly between 0 and 1"),
    (["--lr_sweep=1e-3"], "--lr_sweep needs at least 2 distinct rates"),
]))
def test_bad_wsd_flags_are_one_line_and_exit_code_2(tmp_path, flags, fragment):
  result = subprocess.run(
      [sys.executable, "-m", "launch.sweep", "--design=wsd", "--families=hawk",
       "--vocab_size=259", f"--workdir={tmp_path}", "--dry_run", *flags], cwd=REPO,
      capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, (result.stdout, result.stderr)
  errors = [l for l in result.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1 and fragment in errors[0], result.stderr


@pytest.mark.parametrize("metric, measured", [("loss", 2.0), ("bits_per_byte", 2.9)])
def test_ladder_scores_the_metric_it_forecast(tmp_path, metric, measured):
  run = dataclasses.replace(_plan(tmp_path)[0], eval_loss=2.0, eval_bits_per_byte=2.9,
                            workdir=str(tmp_path / "run"))
  forecast = {"predicted": {"value": 2.5, "low": 2.4, "high": 3.0}}
  scored = ladder.score(run, forecast, metric)
  assert scored["measured"] == measured
  assert scored["error"] == pytest.approx(measured - 2.5)
  assert scored["inside_interval"] == (metric == "bits_per_byte")
  assert json.loads((tmp_path / "run" / "forecast.json").read_text()) == scored
  with pytest.raises(UserError, match="no final bits_per_byte"):
    ladder.score(dataclasses.replace(run, eval_bits_per_byte=None), forecast,
                 "bits_per_byte")


def test_forks_of_a_stable_run_training_elsewhere_wait_instead_of_giving_up(tmp_path):
  """A resumed sweep finds the stable run still training (left by a killed sweep, or
  on another host): its forks are neither started nor given up."""
  runs = _plan(tmp_path, families=("hawk",), sizes=("0.5m",))
  stable = runs[0]
  sweep_job.write_status(stable.workdir, {"state": "running", "host": "another-node",
                                          "pid": 1, "failures": 0})
  lines = []
  states = sweep_execute.execute(runs, ["configs/quickstart.gin"], [],
                                 sweep_local.LocalBackend(parallel=1),
                                 study_dir=str(tmp_path), log=lines.append)
  assert states[stable.name] == "running"
  assert all(states[r.name] == "pending" for r in runs[1:])
  assert f"[sweep] {runs[1].name}: waits for {stable.name}, which is still running" in lines
  assert not any(os.path.exists(r.workdir) for r in runs[1:])
