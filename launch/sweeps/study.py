"""A scaling study from its options: the plan by its design, the learning-rate probes,
the runs on a backend, the results; or the ladder's compute-optimal runs.

The library of `python -m launch.sweep` (launch/sweep.py, whose docstring is the
command's manual; its flags and main are there): `StudyOptions` holds what the flags
say, `check` and `run_study` do it. The designs are `sweep_design` and `wsd_design`,
the probes' fit `size_rule`, the ladder `ladder`, running the runs `sweep_execute`
(through the backends of `sweep_dispatch`), the results and plots `sweep_results`.

Under `--parametrization=mup` (`model.parametrization`) every run, probe and ladder run
is built with `ModelConfig.parametrization='mup'` and `mup_base_width` (so its Gin
bindings carry them), and the study trains ONE learning rate at every size: the rate
μP promises transfers across widths, so fitting a size rule would spend probes on what
the parametrisation already fixes. The rate is `--peak_learning_rate` (tuned
elsewhere, e.g. by benchmarks/mup_transfer.py) or, with `--lr_sweep`, the best rate of
probes at each family's smallest size alone (the cheapest model; under μP any width's
optimum is the base width's), written to `size_rule.json` with exponent 0, where the
ladder finds it. The study records its parametrisation in `study.json` and refuses to
resume under another one: finished runs are never redone, so a changed flag would mix
two parametrisations in one fit.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import gin

from launch.clusters import common
from launch.dispatch import sweep_dispatch
from launch.sweeps import ladder
from launch.sweeps import size_rule
from launch.sweeps import sweep_execute
from launch.sweeps import wsd_design
from launch.sweeps.sweep_design import (FAMILY_PATTERNS, Run, budget_label,
                                        non_embedding_params, parse_size, plan,
                                        plan_isoflop, run_gin)
from launch.sweeps.sweep_results import runs_table_markdown, write_results
from model.config import describe_parametrization
from plumbing import storage
from plumbing.errors import usage_error
from pretrain import gin_config

STUDY_RECORD = "study.json"


@dataclasses.dataclass(frozen=True)
class StudyOptions:
  """A study's settings: one field per flag of `python -m launch.sweep`, of the same
  name and meaning (their help and defaults are there), except `--backend`, whose backend
  is built from the flags and handed to `run_study`."""
  workdir: str
  families: Sequence[str]
  sizes: Sequence[str]
  tokens_per_param: float
  dry_run: bool
  gin_file: Sequence[str]
  gin_param: Sequence[str]
  batch_size: int
  sequence_length: int
  vocab_size: Optional[int]
  warmup_fraction: float
  peak_learning_rate: Optional[float]
  aspect_tolerance: float
  max_steps: Optional[int]
  design: str
  cooldown_tokens_per_param: Sequence[str]
  cooldown_fraction: float
  cooldown_shape: str
  train_optimum: Optional[float]
  metric: str
  replicates: int
  lr_sweep: Sequence[str]
  lr_sweep_sizes: int
  lr_sweep_tokens_per_param: float
  flop_budgets: Sequence[str]
  points_per_budget: int
  isoflop_spread: float
  max_retries: int
  parametrization: str = "standard"
  mup_base_width: Optional[int] = None

  @property
  def resolved_workdir(self) -> str:
    """The study directory: a `gs://` URL as it is, a local path made absolute."""
    return self.workdir if self.workdir.startswith("gs://") else os.path.abspath(
        os.path.expanduser(self.workdir))


def vocab_size_from_gin(gin_files: Sequence[str], gin_params: Sequence[str]) -> int:
  """VOCAB_SIZE as the run's Gin config defines it (ModelConfig.vocab_size otherwise).

  Raises:
    UserError (exit code 2): a bad Gin file or binding, or neither value bound.
  """
  gin_config.parse(gin_files, gin_params)
  try:
    for query in ("%VOCAB_SIZE", "ModelConfig.vocab_size"):
      try:
        return int(gin.query_parameter(query))
      except ValueError:
        continue
  finally:
    gin.clear_config()
  raise usage_error("the Gin files define neither VOCAB_SIZE nor ModelConfig.vocab_size; "
                    "pass --vocab_size")


def _budgets(texts: Sequence[str]) -> List[float]:
  try:
    return common.positive_numbers(texts, "--flop_budgets", "number of FLOPs",
                                   "1e15,3e15,1e16")
  except ValueError as error:
    raise usage_error(str(error)) from None


def check(options: StudyOptions) -> None:
  """Raises UserError (exit code 2) for unknown families, bad sizes or budgets: what
  is wrong with the options before any backend is asked for."""
  unknown = sorted(set(options.families) - set(FAMILY_PATTERNS))
  if unknown:
    raise usage_error(f"unknown families {unknown}; expected some of "
                      f"{sorted(FAMILY_PATTERNS)}")
  for size in options.sizes:
    try:
      parse_size(size)
    except ValueError as error:
      raise usage_error(f"--sizes: {error}") from None
  _budgets(options.flop_budgets)
  _check_parametrization(options)


def _check_parametrization(options: StudyOptions) -> None:
  """μP's flags agree: a base width exactly under mup, and one rate to train at."""
  if options.parametrization == "standard":
    if options.mup_base_width is not None:
      raise usage_error("--mup_base_width is only read with --parametrization=mup; add it "
                        "or drop --mup_base_width")
    return
  if options.mup_base_width is None:
    raise usage_error("--parametrization=mup needs --mup_base_width, the width whose "
                      "proxy the learning rate holds for (e.g. 32)")
  if not options.lr_sweep and options.peak_learning_rate is None:
    raise usage_error("--parametrization=mup trains one learning rate at every size: "
                      "pass --peak_learning_rate=R (tuned at the base width, e.g. by "
                      "benchmarks/mup_transfer.py) or --lr_sweep=3e-3,1e-2,3e-2 to tune "
                      "it at each family's smallest size")


def _parametrized(runs: Sequence[Run], options: StudyOptions) -> List[Run]:
  """`runs` under the study's parametrisation: under μP each model gets it and the base
  width (in its Gin bindings, `run_gin`).

  Raises:
    UserError (exit code 2): the base width does not divide a model's width, or a
      family's block type declares no μP roles; one line naming the run.
  """
  if options.parametrization == "standard":
    return list(runs)
  parametrized = []
  for run in runs:
    try:
      config = run.config.replace(parametrization="mup",
                                  mup_base_width=options.mup_base_width)
    except ValueError as error:
      raise usage_error(f"--parametrization=mup: {run.name} "
                        f"({run.config.width} wide): {error}") from None
    parametrized.append(dataclasses.replace(run, config=config))
  return parametrized


def _described(record: Dict[str, object]) -> str:
  return describe_parametrization(record["parametrization"], record["mup_base_width"])


def _wanted_record(options: StudyOptions) -> Dict[str, object]:
  return {"parametrization": options.parametrization,
          "mup_base_width": options.mup_base_width}


def _check_study_record(options: StudyOptions, workdir: str) -> bool:
  """Refuses a study resumed under another parametrisation than it was run with (its
  `study.json`; a study from before the record, which has runs, was standard). Returns
  whether the study has no record yet.

  Raises:
    UserError (exit code 2): the recorded parametrisation differs; nothing is touched.
  """
  wanted = _wanted_record(options)
  path = storage.join(workdir, STUDY_RECORD)
  if storage.exists(path):
    recorded = json.loads(storage.read_text(path))
  elif storage.exists(storage.join(workdir, "runs")):
    recorded = {"parametrization": "standard", "mup_base_width": None}
  else:
    recorded = None
  if recorded is not None and recorded != wanted:
    raise usage_error(
        f"--parametrization: the study in {workdir} was run under the "
        f"{_described(recorded)} parametrization ({STUDY_RECORD}), not "
        f"{_described(wanted)}; rerun it with its own flags or use a new "
        "--workdir (its runs are kept)")
  return recorded is None


def _record_study(options: StudyOptions, workdir: str) -> None:
  """Writes the study's `study.json` (what `_check_study_record` compares a resume to)."""
  storage.makedirs(workdir)
  storage.write_text(storage.join(workdir, STUDY_RECORD),
                     json.dumps(_wanted_record(options), indent=2) + "\n")


def run_study(options: StudyOptions, backend: sweep_dispatch.Backend) -> None:
  """Plans the study of `options` (`check`ed), runs what is not finished on `backend`
  (the learning-rate probes first, or the ladder instead), and writes the results once
  every run has finished (launch/sweep.py's docstring is the manual).

  Raises:
    UserError (exit code 2): a Gin config without a vocabulary size, a bad WSD design.
  """
  budgets = _budgets(options.flop_budgets)
  workdir = options.resolved_workdir
  vocab_size = options.vocab_size or vocab_size_from_gin(options.gin_file, options.gin_param)
  unrecorded = _check_study_record(options, workdir)
  if options.train_optimum is not None:
    _train_optimum(options, workdir, vocab_size, backend)
    return
  runs, probe_gin = _plan_runs(options, budgets, vocab_size, workdir)
  if unrecorded and not options.dry_run:
    _record_study(options, workdir)
  if options.lr_sweep:
    probes = _parametrized(size_rule.plan_probes(
        plan(options.families, options.sizes, tokens_per_param=options.lr_sweep_tokens_per_param,
             batch_size=options.batch_size, sequence_length=options.sequence_length,
             vocab_size=vocab_size, workdir=workdir, warmup_fraction=options.warmup_fraction,
             aspect_tolerance=options.aspect_tolerance),
        _rates(options), count=_probed_sizes(options), workdir=workdir, extra_gin=probe_gin),
        options)
    if options.dry_run:
      print("# The learning-rate probes (launch.sweeps.size_rule); the study's runs follow at "
            + ("their best rate, one for every size (μP):"
               if options.parametrization == "mup" else "the rates of the rule fitted to them:"))
      print(runs_table_markdown(probes))
    states = _run_all(options, probes, storage.join(workdir, "lr_sweep"), backend)
    if options.dry_run or not _all_finished(states):
      return
    rules = size_rule.fit_rules(probes)
    for line in size_rule.warnings(rules):
      print(line)
    storage.write_text(storage.join(workdir, "size_rule.json"), size_rule.rules_json(
        rules, _rates(options), _probed_sizes(options), options.lr_sweep_tokens_per_param,
        parametrization=describe_parametrization(options.parametrization,
                                                 options.mup_base_width)))
    for run in runs:
      run.peak_learning_rate = rules[run.family](non_embedding_params(run.config))
  if options.dry_run:
    print(runs_table_markdown(runs))
    if backend.here:
      for run in runs:
        print(f"# {run.name}: the run's bindings (--gin_param):")
        print("\n".join("#   " + line for line in run_gin(run).splitlines()))
  states = _run_all(options, runs, workdir, backend)
  if not options.dry_run and _all_finished(states):
    write_results(runs, workdir)


def _train_optimum(options: StudyOptions, workdir: str, vocab_size: int,
                   backend: sweep_dispatch.Backend) -> None:
  """The ladder (launch.sweeps.ladder): each family's compute-optimal model at the budget,
  forecast written first, trained, then scored."""
  budget = options.train_optimum
  runs, forecasts = [], {}
  for family in options.families:
    name = f"{family}_optimum_C{budget_label(budget)}"
    n_opt, forecast, fit = ladder.optimum_size(workdir, name, family, budget,
                                               metric=options.metric,
                                               replicates=options.replicates)
    # One isoFLOP point puts N* = sqrt(C / (6·tokens_per_param)) on N_opt.
    (base,) = plan_isoflop([family], [budget], points_per_budget=1, spread=1.0,
                           tokens_per_param=budget / (6 * n_opt.value ** 2),
                           batch_size=options.batch_size,
                           sequence_length=options.sequence_length, vocab_size=vocab_size,
                           workdir=workdir, warmup_fraction=options.warmup_fraction,
                           aspect_tolerance=options.aspect_tolerance)
    (base,) = _parametrized([base], options)
    run = ladder.ladder_run(base, workdir, name, options.peak_learning_rate)
    forecasts[run.name] = forecast or ladder.make_forecast(run, fit, n_opt, options.metric,
                                                           record=not options.dry_run)
    runs.append(run)
    p = forecasts[run.name]["predicted"]
    print(f"[ladder] {run.name}: {non_embedding_params(run.config):,} non-embedding params, "
          f"{run.tokens:,} tokens; forecast {options.metric} {p['value']:.4f} "
          f"[{p['low']:.4f}, {p['high']:.4f}]")
  if options.dry_run:
    print(runs_table_markdown(runs))
  states = _run_all(options, runs, storage.join(workdir, "ladder"), backend)
  if options.dry_run or not _all_finished(states):
    return
  for run in runs:
    print(ladder.report_line(run.name, ladder.score(run, forecasts[run.name], options.metric)))


def _probed_sizes(options: StudyOptions) -> int:
  """How many of each family's smallest sizes the probes train: one under μP (its best
  rate is every size's), `--lr_sweep_sizes` for the size rule."""
  return 1 if options.parametrization == "mup" else options.lr_sweep_sizes


def _rates(options: StudyOptions) -> List[float]:
  try:
    return size_rule.parse_rates(options.lr_sweep)
  except ValueError as error:
    raise usage_error(str(error)) from None


def _plan_runs(options: StudyOptions, budgets: Sequence[float], vocab_size: int,
               workdir: str) -> Tuple[List[Run], Tuple[str, ...]]:
  """The study's runs by the chosen design, under its parametrisation (`_parametrized`),
  and the schedule bindings its LR probes share with them (launch.sweeps.size_rule)."""
  shared = dict(batch_size=options.batch_size, sequence_length=options.sequence_length,
                vocab_size=vocab_size, workdir=workdir, warmup_fraction=options.warmup_fraction,
                aspect_tolerance=options.aspect_tolerance)
  if options.design != "wsd":
    if budgets:
      return _parametrized(plan_isoflop(
          options.families, budgets, points_per_budget=options.points_per_budget,
          spread=options.isoflop_spread, tokens_per_param=options.tokens_per_param,
          peak_learning_rate=options.peak_learning_rate, **shared), options), ()
    return _parametrized(plan(
        options.families, options.sizes, tokens_per_param=options.tokens_per_param,
        max_steps=options.max_steps, peak_learning_rate=options.peak_learning_rate,
        **shared), options), ()
  if budgets:
    raise usage_error("--design=wsd plans its runs from --sizes and "
                      "--cooldown_tokens_per_param; drop --flop_budgets")
  try:
    wsd = wsd_design.WsdOptions(
        tuple(float(t) for t in options.cooldown_tokens_per_param), options.cooldown_fraction,
        options.cooldown_shape)
  except ValueError as error:
    raise usage_error(str(error).replace("could not convert string to float",
                                         "--cooldown_tokens_per_param: not a number")
                      ) from None
  runs = _parametrized(wsd_design.plan_wsd(
      plan(options.families, options.sizes, tokens_per_param=1.0,
           peak_learning_rate=options.peak_learning_rate, **shared),
      wsd, workdir=workdir, warmup_fraction=options.warmup_fraction), options)
  if options.dry_run:
    print(wsd_design.cost_markdown(wsd_design.study_cost(runs)))
  else:
    storage.makedirs(workdir)
    storage.write_text(storage.join(workdir, "design.json"),
                       wsd_design.design_json(runs, wsd))
  return runs, ("OptimizerConfig.schedule = 'wsd'",
                f"OptimizerConfig.cooldown_shape = {wsd.cooldown_shape!r}",
                f"OptimizerConfig.cooldown_fraction = {wsd.cooldown_fraction!r}")


def _all_finished(states: Dict[str, str]) -> bool:
  """Whether every run finished; otherwise one line naming those that did not."""
  waiting = sorted(name for name, state in states.items()
                   if state != sweep_dispatch.FINISHED)
  if waiting:
    print(f"[sweep] {len(waiting)} run(s) not finished yet ({', '.join(waiting[:5])}"
          f"{', ...' if len(waiting) > 5 else ''}); run the same command again later")
  return not waiting


def tracker_group(workdir: str, study_dir: str) -> str:
  """The experiment trackers' group of a study's runs (`TrainConfig.tracker_group`: a
  W&B group, an MLflow experiment), so that a study is one view there: the sweep
  directory's name, then the part's (`lr_sweep`, `ladder`) when it has its own."""
  name = os.path.basename(workdir.rstrip("/"))
  part = os.path.basename(study_dir.rstrip("/"))
  return name if study_dir.rstrip("/") == workdir.rstrip("/") else f"{name}-{part}"


def _run_all(options: StudyOptions, runs: Sequence[Run], study_dir: str,
             backend: sweep_dispatch.Backend) -> Dict[str, str]:
  """`sweep_execute.run_all` with the study's files, bindings (after the trackers'
  group, which they may override) and retries."""
  group = (f"TrainConfig.tracker_group = "
           f"{tracker_group(options.resolved_workdir, study_dir)!r}")
  return sweep_execute.run_all(runs, options.gin_file, [group, *options.gin_param], backend,
                               max_retries=options.max_retries, study_dir=study_dir,
                               dry_run=options.dry_run)
