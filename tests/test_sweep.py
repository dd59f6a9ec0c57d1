"""launch.sweep: the size rule, budgets, run configs, dry run, resume detection, results."""
import csv
import json
import math
import os
import subprocess
import sys

import gin
import pytest

from launch.sweeps import study
from launch.sweeps import sweep_design
from launch.sweeps import sweep_results
from model import block_registry
from model import counting
from plumbing.errors import UserError
from tiers import slow_after_first
from pretrain import gin_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("text, value", [("0.5m", 500_000), ("2M", 2_000_000),
                                         ("200k", 200_000), ("1.3b", 1_300_000_000),
                                         ("5000", 5000)])
def test_parse_size(text, value):
  assert sweep_design.parse_size(text) == value


@pytest.mark.parametrize("text", ["abc", "1x", "10"])
def test_parse_size_rejects_bad_sizes(text):
  with pytest.raises(ValueError, match="size"):
    sweep_design.parse_size(text)


@pytest.mark.parametrize("family", sorted(sweep_design.FAMILY_PATTERNS))
@pytest.mark.parametrize("size", ["0.2m", "1m", "3m", "100m"])
def test_size_rule_hits_the_target_at_a_sane_shape(family, size):
  target = sweep_design.parse_size(size)
  config = sweep_design.config_for_size(family, target, vocab_size=259, sequence_length=128)
  assert abs(math.log(sweep_design.non_embedding_params(config) / target)) < math.log(1.35)
  assert 64 / 3 <= config.width / config.depth <= 64 * 3 or config.depth == (
      3 if family == "griffin" else 2)
  assert config.block_pattern == sweep_design.FAMILY_PATTERNS[family]
  assert config.width % config.num_heads == 0 and config.mlp_expansion == 3
  if family == "griffin":
    assert "attention" in config.block_types and config.attention_window == 64
  if family == "mqa":
    assert config.attention_window is None


def test_sizes_grow_monotonically():
  counts = [sweep_design.non_embedding_params(sweep_design.config_for_size("hawk", sweep_design.parse_size(s),
                                                             259, 128))
            for s in ("0.2m", "0.5m", "1m", "2m", "3m")]
  assert counts == sorted(counts) and len(set(counts)) == 5


def test_aspect_tolerance_gives_more_distinct_toy_sizes(tmp_path):
  """The default grid has one depth at width 32; a wider aspect tolerance adds deeper
  width-32 models, so a study below ~100k parameters gets 4 distinct sizes, while the
  default is unchanged."""
  sizes = ("35k", "53k", "71k", "89k")

  def shapes(**kwargs):
    configs = [sweep_design.config_for_size("hawk", sweep_design.parse_size(s), 259, 64,
                                            **kwargs) for s in sizes]
    return [(c.width, c.depth, sweep_design.non_embedding_params(c)) for c in configs]

  default = shapes()
  assert default == shapes(aspect_tolerance=sweep_design.ASPECT_TOLERANCE)
  assert len({n for _, _, n in default}) < 4   # 35,616 and 124,608 only
  wide = shapes(aspect_tolerance=12)
  assert [(w, d) for w, d, _ in wide] == [(32, 2), (32, 3), (32, 4), (32, 5)]
  assert [n for _, _, n in wide] == sorted(n for _, _, n in wide) and len(set(wide)) == 4
  assert all(w / d >= 64 / 12 for w, d, _ in wide)
  # Griffin keeps its minimum depth of 3; the tolerance reaches depth 6 at width 32.
  griffin = [sweep_design.config_for_size("griffin", sweep_design.parse_size(s), 259, 64,
                                          aspect_tolerance=12).depth
             for s in ("49k", "67k", "85k", "98k")]
  assert griffin == [3, 4, 5, 6]
  with pytest.raises(ValueError, match="aspect_tolerance"):
    sweep_design.config_for_size("hawk", 50_000, 259, 64, aspect_tolerance=0.5)
  # Both designs pass it on (the ladder sizes its model through plan_isoflop).
  planned = sweep_design.plan(["hawk"], list(sizes), tokens_per_param=1, batch_size=16,
                              sequence_length=64, vocab_size=259, workdir=str(tmp_path),
                              aspect_tolerance=12)
  assert [(r.config.width, r.config.depth) for r in planned] == [(w, d) for w, d, _ in wide]
  (iso,) = sweep_design.plan_isoflop(["hawk"], [1e12], points_per_budget=1, spread=1.0,
                                     tokens_per_param=1e12 / (6 * 71_000 ** 2),
                                     batch_size=16, sequence_length=64, vocab_size=259,
                                     workdir=str(tmp_path), aspect_tolerance=12)
  assert (iso.config.width, iso.config.depth) == (32, 4)


@pytest.mark.slow   # fast tier under 5 min: a sweep dry run (4.5 s); the plain dry run stays fast
def test_dry_run_aspect_tolerance_flag(tmp_path):
  workdir = tmp_path / "sweep"
  result = subprocess.run(
      [sys.executable, "-m", "launch.sweep", "--families=mqa", "--sizes=27k,41k,55k",
       "--aspect_tolerance=12", f"--workdir={workdir}", "--dry_run", "--vocab_size=259",
       "--sequence_length=64", "--gin_file=configs/data/synthetic_induction_heads.gin"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  for params, depth in (("27,296", 2), ("40,928", 3), ("54,560", 4)):
    assert f"| {params} | 32 | {depth} |" in result.stdout
  assert not workdir.exists()


def test_plan_budgets_are_compute_optimal(tmp_path):
  runs = sweep_design.plan(["hawk", "mqa"], ["0.5m", "1m"], tokens_per_param=20, batch_size=8,
                    sequence_length=128, vocab_size=259, workdir=str(tmp_path))
  assert [r.name for r in runs] == ["hawk_0.5m", "hawk_1m", "mqa_0.5m", "mqa_1m"]
  for run in runs:
    n = sweep_design.non_embedding_params(run.config)
    assert run.train_steps == math.ceil(20 * n / (8 * 128))
    assert run.flops == pytest.approx(
        counting.training_flops_per_token(run.config, 128) * run.train_steps * 8 * 128)
    assert run.workdir == os.path.join(str(tmp_path), "runs", run.name)
  capped = sweep_design.plan(["hawk"], ["1m"], tokens_per_param=20, batch_size=8,
                      sequence_length=128, vocab_size=259, workdir=str(tmp_path),
                      max_steps=7)
  assert capped[0].train_steps == 7


def test_run_gin_rebuilds_the_planned_model(tmp_path):
  run = sweep_design.plan(["griffin"], ["0.5m"], tokens_per_param=20, batch_size=4,
                   sequence_length=64, vocab_size=40, workdir=str(tmp_path))[0]
  path = tmp_path / "sweep_run.gin"
  path.write_text(sweep_design.run_gin(run))
  try:
    gin_config.parse([str(path)], [])
    assert gin_config.build_model_config() == run.config
    assert gin.query_parameter("%TRAIN_STEPS") == run.train_steps
    assert gin.query_parameter("%SEQUENCE_LENGTH") == 64
    assert gin.query_parameter("OptimizerConfig.warmup_steps") == math.ceil(
        0.1 * run.train_steps)
  finally:
    gin.clear_config()


def test_dry_run_prints_commands_and_trains_nothing(tmp_path):
  workdir = tmp_path / "sweep"
  result = subprocess.run(
      [sys.executable, "-m", "launch.sweep", "--families=hawk,mqa", "--sizes=0.2m,0.5m",
       f"--workdir={workdir}", "--dry_run", "--vocab_size=259",
       "--gin_file=configs/data/synthetic_induction_heads.gin"],
      cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
  commands = [l for l in result.stdout.splitlines() if "-m pretrain.train" in l]
  assert len(commands) == 4
  assert all("--gin_file=configs/data/synthetic_induction_heads.gin" in c for c in commands)
  assert any(f"--workdir={workdir}/runs/mqa_0.5m" in c for c in commands)
  assert "ModelConfig.block_pattern = ('recurrent', )" in result.stdout
  assert not workdir.exists()


@pytest.mark.parametrize("gin_files, vocab_size", slow_after_first([
    ([], 259),  # the default, configs/quickstart.gin: ModelConfig.vocab_size = 259
    (["--gin_file=configs/base/trainer.gin",
      "--gin_file=configs/data/synthetic_induction_heads.gin"], 18),  # VOCAB_SIZE = 18
]))
def test_dry_run_reads_the_vocabulary_from_gin(tmp_path, gin_files, vocab_size):
  """The README's sweep command, without --vocab_size: the size comes from the Gin files."""
  workdir = tmp_path / "sweep"
  result = subprocess.run(
      [sys.executable, "-m", "launch.sweep", "--families=griffin,hawk",
       "--sizes=0.1m,0.3m", "--tokens_per_param=4", f"--workdir={workdir}", "--dry_run",
       *gin_files],
      cwd=REPO, capture_output=True, text=True, timeout=180)
  assert result.returncode == 0, result.stderr
  assert "Traceback" not in result.stderr
  assert result.stdout.count(f"#   ModelConfig.vocab_size = {vocab_size}\n") == 4
  commands = [l for l in result.stdout.splitlines() if "-m pretrain.train" in l]
  assert len(commands) == 4
  for name in ("griffin_0.1m", "griffin_0.3m", "hawk_0.1m", "hawk_0.3m"):
    assert f"| {name.split('_')[0]} | {name.split('_')[1]} |" in result.stdout
    assert any(f"--workdir={workdir}/runs/{name}" in c for c in commands)
  expected_files = [f.split("=", 1)[1] for f in gin_files] or ["configs/quickstart.gin"]
  assert all(all(f"--gin_file={f}" in c for f in expected_files) for c in commands)
  assert not workdir.exists()


@pytest.mark.parametrize("flags, fragment", slow_after_first([
    (["--families=rwkv"], "unknown families ['rwkv']"),
    (["--sizes=1x"], "cannot read the size '1x'"),
    (["--batch_size=0"], "--batch_size"),
    (["--warmup_fraction=2"], "--warmup_fraction"),
    (["--aspect_tolerance=0.5"], "--aspect_tolerance"),
    (["--gin_file=configs/no_such.gin"], "Gin file not found"),
    (["--workdir="], "--workdir"),
    (["--parametrization=mup"], "--parametrization=mup needs --mup_base_width"),
]))
def test_bad_flag_value_is_one_line_and_exit_code_2(tmp_path, flags, fragment):
  args = ["--families=hawk", "--sizes=1m", f"--workdir={tmp_path}", "--dry_run"] + flags
  result = subprocess.run([sys.executable, "-m", "launch.sweep", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, (result.stdout, result.stderr)
  assert "Traceback" not in result.stderr, result.stderr
  errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and fragment in errors[0], result.stderr
  assert result.stdout == ""


def test_finished_runs_are_recognised_from_their_metrics(tmp_path):
  run = sweep_design.plan(["hawk"], ["0.2m"], tokens_per_param=20, batch_size=4,
                   sequence_length=32, vocab_size=18, workdir=str(tmp_path), max_steps=10)[0]
  assert sweep_results.final_eval(run) is None and not sweep_results.collect(run)
  os.makedirs(run.workdir)
  path = os.path.join(run.workdir, "metrics.jsonl")
  with open(path, "w") as f:
    f.write(json.dumps({"step": 5, "loss": 2.0}) + "\n")
    f.write(json.dumps({"step": 5, "eval_loss": 2.1}) + "\n")
  assert sweep_results.final_eval(run) is None               # interrupted half-way: not finished
  with open(path, "a") as f:
    f.write(json.dumps({"step": 10, "eval_loss": 1.5, "eval_bits_per_byte": 2.2}) + "\n")
    f.write('{"step": 11, "lo')                       # a line cut short by a kill
  assert sweep_results.final_eval(run)["eval_loss"] == 1.5
  assert sweep_results.collect(run) and (run.eval_loss, run.eval_bits_per_byte) == (1.5, 2.2)


def test_results_files(tmp_path):
  runs = sweep_design.plan(["hawk", "mqa"], ["0.2m", "0.5m", "1m"], tokens_per_param=20,
                    batch_size=8, sequence_length=128, vocab_size=259,
                    workdir=str(tmp_path))
  for run in runs:  # losses falling as a power of compute, different per family
    run.eval_loss = (5.0 if run.family == "hawk" else 6.0) * (run.flops / 1e12) ** -0.1
    run.eval_bits_per_byte = run.eval_loss / math.log(2)
  runs[-1].eval_bits_per_byte = None                  # a vocabulary without text
  fits = sweep_results.write_results(runs, str(tmp_path), log=lambda _: None)
  with open(tmp_path / "sweep.csv") as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 6 and rows[0]["family"] == "hawk" and float(rows[0]["loss"]) > 0
  assert list(rows[0]).index("bits_per_byte") == list(rows[0]).index("loss") + 1
  assert float(rows[0]["bits_per_byte"]) == pytest.approx(
      float(rows[0]["loss"]) / math.log(2), rel=1e-5)
  assert rows[-1]["bits_per_byte"] == ""
  assert set(fits) == {"hawk", "mqa"}
  assert json.loads((tmp_path / "fit.json").read_text())["hawk"]["alpha"] == pytest.approx(
      0.1, abs=1e-3)
  assert (tmp_path / "scaling.png").stat().st_size > 1000
  assert "| mqa | 1m |" in (tmp_path / "scaling.md").read_text()


@pytest.mark.slow
@pytest.mark.soak  # 80 s of real runs; CI keeps a study end to end through the same
#                    machinery (test_sweep_backend) and the sweep's dry runs here
def test_toy_sweep_trains_fits_and_resumes(tmp_path):
  """Hawk at 2 sizes with the real trainer, in two calls: the second adds only the size
  the first did not train, then fits and plots both."""
  workdir = tmp_path / "sweep"
  env = dict(os.environ, GRIFFIN_DATA_CACHE=str(tmp_path / "cache"))
  env.pop("XLA_FLAGS", None)  # each run is one ordinary single-device process

  def sweep_cmd(sizes):
    return [sys.executable, "-m", "launch.sweep", "--families=hawk",
            f"--sizes={sizes}", f"--workdir={workdir}", "--vocab_size=259",
            "--batch_size=2", "--sequence_length=32", "--max_steps=3",
            "--gin_file=configs/base/trainer.gin", "--gin_file=configs/data/text_files.gin",
            "--gin_param=TRAIN_FILES='{stdlib}/json/*.py'",
            "--gin_param=text_files_task.validation_fraction=0.5",
            "--gin_param=EVAL_EVERY=0", "--gin_param=TrainConfig.eval_batches=1"]

  first = subprocess.run(sweep_cmd("30k"), cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
  assert first.returncode == 0, first.stderr[-3000:]
  hawk_metrics = workdir / "runs" / "hawk_30k" / "metrics.jsonl"
  stamp = hawk_metrics.stat().st_mtime_ns
  second = subprocess.run(sweep_cmd("30k,120k"), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
  assert second.returncode == 0, second.stderr[-3000:]
  assert second.stdout.count(", skipped") == 1 and "hawk_120k: " in second.stdout
  assert hawk_metrics.stat().st_mtime_ns == stamp          # finished runs are not redone
  with open(workdir / "sweep.csv") as f:
    rows = list(csv.DictReader(f))
  assert [(r["family"], r["size"]) for r in rows] == [("hawk", "30k"), ("hawk", "120k")]
  assert all(0 < float(r["loss"]) < 10 and int(r["train_steps"]) == 3 for r in rows)
  assert all(float(r["bits_per_byte"]) > 0 for r in rows)   # byte vocabulary: text
  flops = [float(r["flops"]) for r in rows]
  assert flops[1] > flops[0]
  fits = json.loads((workdir / "fit.json").read_text())
  assert set(fits) == {"hawk"} and "alpha" in fits["hawk"]
  assert (workdir / "scaling.png").exists() and (workdir / "scaling.md").exists()


# μP studies (launch.sweeps.study): in process, with a backend that finishes each job at
# once, so the study's logic (bindings, probes, the one rate, the record) costs no training.
RATES = ["3e-3", "1e-2", "3e-2"]


def _study_options(workdir, **changes):
  """A study as `launch.sweep`'s flag defaults give it, two sizes of two widths."""
  values = dict(workdir=str(workdir), families=["hawk", "mqa"], sizes=["30k", "120k"],
                tokens_per_param=20.0, dry_run=False, gin_file=["configs/quickstart.gin"],
                gin_param=[], batch_size=8, sequence_length=128, vocab_size=259,
                warmup_fraction=0.1, peak_learning_rate=None, aspect_tolerance=3.0,
                max_steps=None, design="cosine", cooldown_tokens_per_param=["5"],
                cooldown_fraction=0.2, cooldown_shape="1-sqrt", train_optimum=None,
                metric="loss", replicates=200, lr_sweep=[], lr_sweep_sizes=2,
                lr_sweep_tokens_per_param=20.0, flop_budgets=[], points_per_budget=5,
                isoflop_spread=3.0, max_retries=1, parametrization="mup",
                mup_base_width=32)
  values.update(changes)
  return study.StudyOptions(**values)


class _InstantBackend:
  """Finishes every job it is given at once with a final evaluation whose loss is a
  parabola in log rate, lowest at 1e-2; keeps each job's Gin bindings by name."""
  name = "instant"
  here = True

  def __init__(self):
    self.bindings = {}

  def dispatch(self, jobs, study_info):
    del study_info
    for job in jobs:
      bindings = dict(a.split("=", 1)[1].split(" = ", 1) for a in job.command
                      if a.startswith("--gin_param=") and " = " in a)
      self.bindings[job.name] = bindings
      loss = 2.0 + math.log(float(bindings["OptimizerConfig.peak_learning_rate"]) / 1e-2) ** 2
      os.makedirs(job.run_dir, exist_ok=True)
      with open(os.path.join(job.run_dir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": int(bindings["TRAIN_STEPS"]), "eval_loss": loss}) + "\n")
    return []


def test_mup_study_trains_every_size_at_one_rate_probed_at_the_smallest(tmp_path):
  backend = _InstantBackend()
  options = _study_options(tmp_path / "mup", lr_sweep=RATES)
  study.check(options)
  study.run_study(options, backend)
  probes = sorted(n for n in backend.bindings if "_lr" in n)
  assert probes == sorted(f"{f}_30k_lr{float(r):g}" for f in ("hawk", "mqa") for r in RATES)
  widths = {backend.bindings[n]["ModelConfig.width"] for n in backend.bindings}
  assert widths == {"32", "64"}         # m = 1 and 2: the rate crosses widths
  for bindings in backend.bindings.values():
    assert bindings["ModelConfig.parametrization"] == "'mup'"
    assert bindings["ModelConfig.mup_base_width"] == "32"
  rates = {float(backend.bindings[f"{f}_{s}"]["OptimizerConfig.peak_learning_rate"])
           for f in ("hawk", "mqa") for s in ("30k", "120k")}
  assert len(rates) == 1 and rates.pop() == pytest.approx(1e-2)
  record = json.loads((tmp_path / "mup" / "size_rule.json").read_text())
  assert record["parametrization"] == "mup (base width 32)"
  assert record["sizes_per_family"] == 1
  assert all(f["exponent"] == 0 for f in record["families"].values())
  assert json.loads((tmp_path / "mup" / "study.json").read_text()) == {
      "parametrization": "mup", "mup_base_width": 32}
  # A given rate instead: no probes, that rate everywhere.
  given = _InstantBackend()
  study.run_study(_study_options(tmp_path / "given", peak_learning_rate=3e-3), given)
  assert sorted(given.bindings) == ["hawk_120k", "hawk_30k", "mqa_120k", "mqa_30k"]
  assert {b["OptimizerConfig.peak_learning_rate"] for b in given.bindings.values()} == {
      "0.003"}


def test_a_study_resumed_under_another_parametrization_is_refused(tmp_path):
  study.run_study(_study_options(tmp_path, peak_learning_rate=3e-3), _InstantBackend())
  before = sorted(p.name for p in (tmp_path / "runs").iterdir())
  for changes in (dict(parametrization="standard", mup_base_width=None),
                  dict(mup_base_width=16)):
    backend = _InstantBackend()
    with pytest.raises(UserError, match=r"was run under the mup \(base width 32\) "
                                        r"parametrization \(study.json\)") as info:
      study.run_study(_study_options(tmp_path, peak_learning_rate=3e-3, **changes), backend)
    assert "\n" not in str(info.value) and not backend.bindings
  assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == before
  # A study from before the record, with runs, was standard.
  (tmp_path / "study.json").unlink()
  with pytest.raises(UserError, match="was run under the standard parametrization"):
    study.run_study(_study_options(tmp_path, peak_learning_rate=3e-3), _InstantBackend())


class _NoRoles:
  """A block type that declares no μP roles (never built: the study stops first)."""
  name = "no_roles"
  layer = object

  def param_count(self, config):
    return 4 * config.width * config.width


@pytest.fixture
def block_without_roles():
  block_registry.register(_NoRoles())
  yield
  block_registry.unregister(_NoRoles.name)


@pytest.mark.parametrize("changes, fragment", [
    (dict(parametrization="standard"), "--mup_base_width is only read with "
                                       "--parametrization=mup"),
    (dict(mup_base_width=None), "--parametrization=mup needs --mup_base_width"),
    (dict(), "--parametrization=mup trains one learning rate at every size"),
    (dict(mup_base_width=64, peak_learning_rate=1e-2),
     "mqa_30k (32 wide): ModelConfig.mup_base_width=64 must divide width=32"),
    (dict(families=["no_roles"], peak_learning_rate=1e-2),
     "block type 'no_roles' declares no parameter roles"),
])
def test_bad_mup_study_options_are_one_line(tmp_path, block_without_roles, changes, fragment):
  del block_without_roles
  options = _study_options(tmp_path, **{"families": ["mqa"], **changes})
  backend = _InstantBackend()
  with pytest.raises(UserError) as info:
    study.check(options)
    study.run_study(options, backend)
  assert fragment in str(info.value) and "\n" not in str(info.value)
  assert info.value.exit_code == 2 and not backend.bindings and not os.listdir(tmp_path)
