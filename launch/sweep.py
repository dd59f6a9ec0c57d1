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
  python -m launch.sweep ... --parametrization=mup --mup_base_width=32 \
      (--lr_sweep=3e-3,1e-2,3e-2 | --peak_learning_rate=R)
  python -m launch.sweep --train_optimum=C --workdir=DIR [the study's flags]

`--design=wsd` is the forked design (`launch.sweeps.wsd_design`: one constant-rate run per
size, cooldowns forked from its checkpoints); `--lr_sweep` fits a learning rate per
size before the study (`launch.sweeps.size_rule`); `--train_optimum` trains the model the
study's fit recommends for a larger budget and scores its forecast (`launch.sweeps.ladder`);
`--parametrization=mup` trains every run under μP with one learning rate for all sizes
instead of the size rule (`launch.sweeps.study`, docs/scaling.md).

With the default `--design=cosine`, two designs. With `--sizes`, every (family, size)
gets a model by the size rule below and the compute-optimal budget `tokens_per_param`
x non-embedding parameters (Chinchilla's ~20 by default). With `--flop_budgets` (the isoFLOP design,
`plan_isoflop`), every budget gets `--points_per_budget` sizes around its expected
optimum, each trained for the steps that spend the budget by the trainer's own FLOPs
count (`pretrain.observability.flops`, the numerator of MFU). Each run is `python -m pretrain.train`
in `DIR/runs/<name>` with the user's Gin files, the run's model and budget as bindings,
then the user's bindings.

`--backend` picks where the runs execute, by name among the registered backends
(`launch.dispatch.sweep_dispatch`: N at a time here, one SLURM job array, a GKE JobSet per
run, a TPU queued resource per run; each backend module defines its own flags); `--dry_run`
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

This module is the command line (flags and main); the study is `launch.sweeps.study`
(`StudyOptions`, `run_study`), whose parts live apart: the size rule and the designs in
`launch.sweeps.sweep_design`, running the runs in `launch.sweeps.sweep_execute` (through
the backends of `launch.dispatch.sweep_dispatch`), the results and plots in
`launch.sweeps.sweep_results`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from absl import flags

from launch.dispatch import sweep_dispatch
from launch.scaling import scaling_fit
from launch.sweeps import study
from launch.sweeps import sweep_design
from launch.sweeps.sweep_design import FAMILY_PATTERNS
from plumbing import cli

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
  flags.DEFINE_enum("parametrization", "standard", ("standard", "mup"),
                    "standard: the size rule's rates (--lr_sweep) or one Gin rate; mup: every "
                    "run (ModelConfig.parametrization) under μP at --mup_base_width, "
                    "trained at ONE rate: --peak_learning_rate, or the best of --lr_sweep "
                    "probed at each family's smallest size only (launch.sweeps.study).")
  flags.DEFINE_integer("mup_base_width", None, "μP: the proxy width the rate holds for "
                       "(ModelConfig.mup_base_width); must divide every size's width "
                       "(the size rule's widths are multiples of 32).", lower_bound=1)
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


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  options = study.StudyOptions(**{field.name: FLAGS[field.name].value
                                  for field in dataclasses.fields(study.StudyOptions)})
  study.check(options)
  study.run_study(options, sweep_dispatch.get(FLAGS.backend).from_flags(FLAGS))


if __name__ == "__main__":
  define_flags()
  cli.run(main)
