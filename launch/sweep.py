r"""Scaling-law studies: plan the runs, run them here or on a cluster, collect, fit.

  python -m launch.sweep --families=griffin,hawk,mqa --sizes=0.5m,1m,2m \
      [--tokens_per_param=20] --workdir=DIR [--dry_run] [--gin_file=DATA.gin ...] \
      [--gin_param=B ...] [--batch_size=8 --sequence_length=128] [--max_steps=N]
  python -m launch.sweep --families=griffin,hawk,mqa --flop_budgets=1e15,3e15,1e16 \
      --points_per_budget=5 [--isoflop_spread=3] --workdir=DIR \
      [--backend=local|slurm|gke|tpu_vm] [--parallel=N] [--max_retries=1] [--dry_run]
  python -m launch.sweep --design=wsd --families=griffin,hawk,mqa --sizes=0.5m,1m,2m \
      --cooldown_tokens_per_param=5,10,20,40 [--cooldown_fraction=0.2] --workdir=DIR
  python -m launch.sweep ... [--lr_sweep=1e-3,3e-3,1e-2 [--lr_sweep_sizes=2]]
  python -m launch.sweep --train_optimum=C --workdir=DIR [the study's flags]

`--design=wsd` is the forked design (`launch.sweeps.wsd_design`: one constant-rate run per
size, cooldowns forked from its checkpoints); `--lr_sweep` fits a learning rate per
size before the study (`launch.sweeps.size_rule`); `--train_optimum` trains the model the
study's fit recommends for a larger budget and scores its forecast (`launch.sweeps.ladder`).

With the default `--design=cosine`, two designs. With `--sizes`, every (family, size)
gets a model by the size rule below and the compute-optimal budget `tokens_per_param`
x non-embedding parameters (Chinchilla's ~20 by default). With `--flop_budgets` (the isoFLOP design,
`plan_isoflop`), every budget gets `--points_per_budget` sizes around its expected
optimum, each trained for the steps that spend the budget by the trainer's own FLOPs
count (`pretrain.observability.flops`, the numerator of MFU). Each run is `python -m pretrain.train`
in `DIR/runs/<name>` with the user's Gin files, the run's model and budget as bindings,
then the user's bindings.

`--backend` picks where the runs execute, by name among the registered backends
(`launch.sweeps.sweep_dispatch`: N at a time here, one SLURM job array, a GKE JobSet per run,
a TPU queued resource per run; each backend module defines its own flags); `--dry_run`
prints the plan and every job spec; locally, a progress line with an ETA goes to
stderr as runs start and end (`launch.sweeps.sweep_progress`). What a run needs is read from
its directory (finished, running, interrupted, failed, pending), so running the same
command again resumes a study, retries failed runs up to `--max_retries`, and never
redoes finished work. Once every run is finished the sweep writes `sweep.csv` (what
`launch.scaling_fit` reads: `params`, `tokens`, `flops`, `flop_budget`, `loss`,
`bits_per_byte` (empty where the vocabulary has no text), ...),
`fit.json`, `scaling.png` and `scaling.md` (L(C) = E + A·C^(-α) per family) in DIR; the
three Chinchilla approaches are `python -m launch.scaling_fit --runs=DIR`
(docs/scaling.md).

Every run warms its learning rate up over `warmup_fraction` of its steps (the
optimizer's fixed default would make a short run all warm-up) and may get a common
`--peak_learning_rate`.

This module is the command line; the study's parts live apart: the size rule and the
designs in `launch.sweeps.sweep_design`, running the runs in `launch.sweeps.sweep_execute` (through
the backends of `launch.sweeps.sweep_dispatch`), the results and plots in
`launch.sweeps.sweep_results`.
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

from absl import flags
import gin

from launch.clusters import common
from launch.sweeps import ladder
from launch.scaling import scaling_fit
from launch.sweeps import size_rule
from launch.sweeps import sweep_design
from launch.sweeps import sweep_dispatch
from launch.sweeps import sweep_execute
from launch.sweeps import wsd_design
from launch.sweeps.sweep_design import (FAMILY_PATTERNS, Run, budget_label,
                                        non_embedding_params, parse_size, plan,
                                        plan_isoflop, run_gin)
from launch.sweeps.sweep_results import runs_table_markdown, write_results
from plumbing import cli
from plumbing import storage
from plumbing.errors import usage_error
from pretrain import gin_config


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


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Command-line flags, defined only when run as a program so that importing this
  module next to other entry points (tests, notebooks) cannot clash."""
  flags.DEFINE_list("families", ["griffin", "hawk", "mqa"],
                    f"Model families, from {sorted(FAMILY_PATTERNS)}.")
  flags.DEFINE_list("sizes", ["0.5m", "1m", "2m"],
                    "Target non-embedding parameter counts, e.g. 0.5m,1m,2m.")
  flags.DEFINE_float("tokens_per_param", 20.0,
                     "Compute-optimal budget: tokens per non-embedding parameter.",
                     lower_bound=0.0)
  flags.DEFINE_string("workdir", None, "Sweep directory (runs/ and the results).")
  flags.DEFINE_bool("dry_run", False, "Print the launch commands instead of running them.")
  flags.DEFINE_multi_string("gin_file", ["configs/quickstart.gin"],
                            "Trainer/data Gin files of every run (the model is the sweep's).")
  flags.DEFINE_multi_string("gin_param", [], "Extra Gin bindings of every run.")
  flags.DEFINE_integer("batch_size", 8, "Global batch (sequences) of every run.",
                       lower_bound=1)
  flags.DEFINE_integer("sequence_length", 128, "Tokens per sequence of every run.",
                       lower_bound=1)
  flags.DEFINE_integer("vocab_size", None, "Vocabulary size (default: the Gin VOCAB_SIZE).",
                       lower_bound=1)
  flags.DEFINE_float("warmup_fraction", 0.1, "Warm-up steps as a fraction of each run.",
                     lower_bound=0.0, upper_bound=1.0)
  flags.DEFINE_float("peak_learning_rate", None,
                     "Peak learning rate of every run (default: the Gin config's).")
  flags.DEFINE_float("aspect_tolerance", sweep_design.ASPECT_TOLERANCE,
                     "Size rule: candidate depths keep width/depth within this factor of "
                     "64 (larger: narrower, deeper models, more distinct sizes at toy "
                     "scale). Pass the same value to --train_optimum as to the study.",
                     lower_bound=1.0)
  flags.DEFINE_integer("max_steps", None,
                       "Cap on the steps of each run (for smoke tests; breaks the "
                       "compute-optimal budget, which the table then shows).", lower_bound=1)
  flags.DEFINE_enum("design", "cosine", ("cosine", "wsd"),
                    "cosine: every run decays to its own end (--sizes or --flop_budgets); "
                    "wsd: one stable run per size, cooldowns forked from it "
                    "(launch.sweeps.wsd_design).")
  flags.DEFINE_list("cooldown_tokens_per_param", ["5", "10", "20", "40"],
                    "WSD design: the forks' tokens per non-embedding parameter.")
  flags.DEFINE_float("cooldown_fraction", 0.2, "WSD design: share of each fork's steps "
                     "spent cooling down.")
  flags.DEFINE_enum("cooldown_shape", "1-sqrt", ("linear", "1-sqrt"),
                    "WSD design: the cooldown's shape (Hägele et al. find 1-sqrt best).")
  flags.DEFINE_float("train_optimum", None, "The ladder (launch.sweeps.ladder): train each "
                     "family's compute-optimal model for this many FLOPs, as the study's "
                     "approach-3 fit predicts, and score the forecast.", lower_bound=0.0)
  flags.DEFINE_enum("metric", "loss", tuple(scaling_fit.METRICS),
                    "The ladder: the fitted and forecast metric (final eval_loss or "
                    "eval_bits_per_byte).")
  flags.DEFINE_integer("replicates", 200, "The ladder: bootstrap replicates of the fit.",
                       lower_bound=10)
  flags.DEFINE_list("lr_sweep", [], "Size rule (launch.sweeps.size_rule): learning rates probed "
                    "at the smallest sizes, e.g. 1e-3,3e-3,1e-2; every run then trains at "
                    "the fitted rate for its size (replaces --peak_learning_rate).")
  flags.DEFINE_integer("lr_sweep_sizes", 2, "Size rule: how many of the smallest sizes "
                       "are probed.", lower_bound=1)
  flags.DEFINE_float("lr_sweep_tokens_per_param", 20.0, "Size rule: the probes' tokens "
                     "per non-embedding parameter.", lower_bound=0.0)
  flags.DEFINE_list("flop_budgets", [], "IsoFLOP design: training FLOP budgets, e.g. "
                    "1e15,3e15,1e16 (replaces --sizes).")
  flags.DEFINE_integer("points_per_budget", 5, "IsoFLOP design: sizes per budget.",
                       lower_bound=1)
  flags.DEFINE_float("isoflop_spread", 3.0, "IsoFLOP design: sizes span N*/spread to "
                     "N*·spread around the expected optimum N*.", lower_bound=1.0)
  flags.DEFINE_enum("backend", "local", sweep_dispatch.names(), "Where the runs execute.")
  flags.DEFINE_integer("max_retries", 1, "Times a failed run is started again.",
                       lower_bound=0)
  for name in sweep_dispatch.names():   # each backend's own flags (--parallel, --nodes, ...)
    sweep_dispatch.get(name).define_flags()
  flags.mark_flag_as_required("workdir")
  flags.register_validator("workdir", lambda value: value is None or bool(value.strip()),
                           message="--workdir must name a directory")


def _budgets(texts: Sequence[str]) -> List[float]:
  try:
    return common.positive_numbers(texts, "--flop_budgets", "number of FLOPs",
                                   "1e15,3e15,1e16")
  except ValueError as error:
    raise usage_error(str(error)) from None


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  unknown = sorted(set(FLAGS.families) - set(FAMILY_PATTERNS))
  if unknown:
    raise usage_error(f"unknown families {unknown}; expected some of "
                      f"{sorted(FAMILY_PATTERNS)}")
  for size in FLAGS.sizes:
    try:
      parse_size(size)
    except ValueError as error:
      raise usage_error(f"--sizes: {error}") from None
  budgets = _budgets(FLAGS.flop_budgets)
  backend = sweep_dispatch.get(FLAGS.backend).from_flags(FLAGS)
  workdir = FLAGS.workdir if FLAGS.workdir.startswith("gs://") else os.path.abspath(
      os.path.expanduser(FLAGS.workdir))
  vocab_size = FLAGS.vocab_size or vocab_size_from_gin(FLAGS.gin_file, FLAGS.gin_param)
  if FLAGS.train_optimum is not None:
    _train_optimum(workdir, vocab_size, backend)
    return
  runs, probe_gin = _plan_runs(budgets, vocab_size, workdir)
  if FLAGS.lr_sweep:
    probes = size_rule.plan_probes(
        plan(FLAGS.families, FLAGS.sizes, tokens_per_param=FLAGS.lr_sweep_tokens_per_param,
             batch_size=FLAGS.batch_size, sequence_length=FLAGS.sequence_length,
             vocab_size=vocab_size, workdir=workdir, warmup_fraction=FLAGS.warmup_fraction,
             aspect_tolerance=FLAGS.aspect_tolerance),
        _rates(), count=FLAGS.lr_sweep_sizes, workdir=workdir, extra_gin=probe_gin)
    if FLAGS.dry_run:
      print("# The learning-rate probes (launch.sweeps.size_rule); the study's runs follow at the "
            "rates of the rule fitted to them:")
      print(runs_table_markdown(probes))
    states = _run_all(probes, storage.join(workdir, "lr_sweep"), backend)
    if FLAGS.dry_run or not _all_finished(states):
      return
    rules = size_rule.fit_rules(probes)
    for line in size_rule.warnings(rules):
      print(line)
    storage.write_text(storage.join(workdir, "size_rule.json"), size_rule.rules_json(
        rules, _rates(), FLAGS.lr_sweep_sizes, FLAGS.lr_sweep_tokens_per_param))
    for run in runs:
      run.peak_learning_rate = rules[run.family](non_embedding_params(run.config))
  if FLAGS.dry_run:
    print(runs_table_markdown(runs))
    if backend.here:
      for run in runs:
        print(f"# {run.name}: the run's bindings (--gin_param):")
        print("\n".join("#   " + line for line in run_gin(run).splitlines()))
  states = _run_all(runs, workdir, backend)
  if not FLAGS.dry_run and _all_finished(states):
    write_results(runs, workdir)


def _train_optimum(workdir: str, vocab_size: int, backend: sweep_dispatch.Backend) -> None:
  """The ladder (launch.sweeps.ladder): each family's compute-optimal model at the budget,
  forecast written first, trained, then scored."""
  budget = FLAGS.train_optimum
  runs, forecasts = [], {}
  for family in FLAGS.families:
    name = f"{family}_optimum_C{budget_label(budget)}"
    n_opt, forecast, fit = ladder.optimum_size(workdir, name, family, budget,
                                               metric=FLAGS.metric,
                                               replicates=FLAGS.replicates)
    # One isoFLOP point puts N* = sqrt(C / (6·tokens_per_param)) on N_opt.
    (base,) = plan_isoflop([family], [budget], points_per_budget=1, spread=1.0,
                           tokens_per_param=budget / (6 * n_opt.value ** 2),
                           batch_size=FLAGS.batch_size,
                           sequence_length=FLAGS.sequence_length, vocab_size=vocab_size,
                           workdir=workdir, warmup_fraction=FLAGS.warmup_fraction,
                           aspect_tolerance=FLAGS.aspect_tolerance)
    run = ladder.ladder_run(base, workdir, name, FLAGS.peak_learning_rate)
    forecasts[run.name] = forecast or ladder.make_forecast(run, fit, n_opt, FLAGS.metric,
                                                           record=not FLAGS.dry_run)
    runs.append(run)
    p = forecasts[run.name]["predicted"]
    print(f"[ladder] {run.name}: {non_embedding_params(run.config):,} non-embedding params, "
          f"{run.tokens:,} tokens; forecast {FLAGS.metric} {p['value']:.4f} "
          f"[{p['low']:.4f}, {p['high']:.4f}]")
  if FLAGS.dry_run:
    print(runs_table_markdown(runs))
  states = _run_all(runs, storage.join(workdir, "ladder"), backend)
  if FLAGS.dry_run or not _all_finished(states):
    return
  for run in runs:
    print(ladder.report_line(run.name, ladder.score(run, forecasts[run.name], FLAGS.metric)))


def _rates() -> List[float]:
  try:
    return size_rule.parse_rates(FLAGS.lr_sweep)
  except ValueError as error:
    raise usage_error(str(error)) from None


def _plan_runs(budgets: Sequence[float], vocab_size: int, workdir: str
               ) -> Tuple[List[Run], Tuple[str, ...]]:
  """The study's runs by the chosen design, and the schedule bindings its LR probes
  share with them (launch.sweeps.size_rule)."""
  shared = dict(batch_size=FLAGS.batch_size, sequence_length=FLAGS.sequence_length,
                vocab_size=vocab_size, workdir=workdir, warmup_fraction=FLAGS.warmup_fraction,
                aspect_tolerance=FLAGS.aspect_tolerance)
  if FLAGS.design != "wsd":
    if budgets:
      return plan_isoflop(FLAGS.families, budgets, points_per_budget=FLAGS.points_per_budget,
                          spread=FLAGS.isoflop_spread,
                          tokens_per_param=FLAGS.tokens_per_param,
                          peak_learning_rate=FLAGS.peak_learning_rate, **shared), ()
    return plan(FLAGS.families, FLAGS.sizes, tokens_per_param=FLAGS.tokens_per_param,
                max_steps=FLAGS.max_steps, peak_learning_rate=FLAGS.peak_learning_rate,
                **shared), ()
  if budgets:
    raise usage_error("--design=wsd plans its runs from --sizes and "
                      "--cooldown_tokens_per_param; drop --flop_budgets")
  try:
    options = wsd_design.WsdOptions(
        tuple(float(t) for t in FLAGS.cooldown_tokens_per_param), FLAGS.cooldown_fraction,
        FLAGS.cooldown_shape)
  except ValueError as error:
    raise usage_error(str(error).replace("could not convert string to float",
                                         "--cooldown_tokens_per_param: not a number")
                      ) from None
  runs = wsd_design.plan_wsd(
      plan(FLAGS.families, FLAGS.sizes, tokens_per_param=1.0,
           peak_learning_rate=FLAGS.peak_learning_rate, **shared),
      options, workdir=workdir, warmup_fraction=FLAGS.warmup_fraction)
  if FLAGS.dry_run:
    print(wsd_design.cost_markdown(wsd_design.study_cost(runs)))
  else:
    storage.makedirs(workdir)
    storage.write_text(storage.join(workdir, "design.json"),
                       wsd_design.design_json(runs, options))
  return runs, ("OptimizerConfig.schedule = 'wsd'",
                f"OptimizerConfig.cooldown_shape = {options.cooldown_shape!r}",
                f"OptimizerConfig.cooldown_fraction = {options.cooldown_fraction!r}")


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


def _run_all(runs: Sequence[Run], study_dir: str,
             backend: sweep_dispatch.Backend) -> Dict[str, str]:
  """`sweep_execute.run_all` with the command line's files, bindings (after the
  trackers' group, which they may override) and retries."""
  workdir = FLAGS.workdir if FLAGS.workdir.startswith("gs://") else os.path.abspath(
      os.path.expanduser(FLAGS.workdir))
  group = f"TrainConfig.tracker_group = {tracker_group(workdir, study_dir)!r}"
  return sweep_execute.run_all(runs, FLAGS.gin_file, [group, *FLAGS.gin_param], backend,
                               max_retries=FLAGS.max_retries, study_dir=study_dir,
                               dry_run=FLAGS.dry_run)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
