"""Scaling-law analysis of a study or of any runs: `python -m launch.scaling_fit`.

  python -m launch.scaling_fit --runs=FILE.csv|STUDY_DIR [--approach=1|2|3|all] [--json]
      [--metric=loss|bits_per_byte] [--target_flops=1e21] [--plots=DIR]
      [--replicates=200] [--confidence=0.95]

`--runs` is a CSV with at least the columns `params`, `tokens` and the metric's (`loss`,
or `bits_per_byte` with `--metric=bits_per_byte`; and `flops` where known, otherwise
6·N·D; `family` to fit families separately; `flop_budget` to name a run's isoFLOP
budget, otherwise runs within 10% of each other's compute share one; rows with an empty
metric are unfinished and skipped; rows whose `role` is `stable`, a forked study's
uncooled constant-rate runs, are skipped too), or a study directory written by `launch.sweep`,
whose `sweep.csv` is read and whose runs' `metrics.jsonl` evaluation rows (`eval_loss`
or `eval_bits_per_byte`) give approach 1 its training curves. Bits per byte compare runs
whose vocabularies differ; the fits treat either metric as "the loss". It prints, per
family, the fits of the three Chinchilla approaches (`launch.scaling.scaling_laws`) with
bootstrap intervals and the compute-optimal N and D at `--target_flops` (default: the
largest compute in the data), as tables or, with `--json`, as one JSON object; `--plots`
writes the figures (`launch.scaling.scaling_plots`). `--runs`, the runs' workdirs and `--plots`
may be `gs://` or `s3://` URLs (`plumbing.storage`).
"""
from __future__ import annotations

import json
import sys
from typing import Sequence

from absl import flags

from launch.scaling import scaling_fit
from launch.scaling import scaling_laws
from plumbing import cli
from plumbing.errors import UserError


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Command-line flags, defined only when run as a program."""
  flags.DEFINE_string("runs", None, "CSV (params,tokens,loss[,bits_per_byte,flops,family,"
                      "flop_budget]) or a launch.sweep study directory.")
  flags.DEFINE_enum("approach", "all", scaling_fit.APPROACHES, "Chinchilla approach(es) to fit.")
  flags.DEFINE_enum("metric", "loss", tuple(scaling_fit.METRICS), "What to fit: the final evaluation "
                    "loss (nats/token) or bits per byte (comparable across vocabularies).")
  flags.DEFINE_bool("json", False, "Print one JSON object instead of tables.")
  flags.DEFINE_float("target_flops", None, "Compute budget to answer for (default: the "
                     "largest in the data).", lower_bound=0.0)
  flags.DEFINE_string("plots", None, "Directory (or gs:// / s3:// URL) for the PNG "
                      "figures.")
  flags.DEFINE_integer("replicates", 200, "Bootstrap replicates per approach.",
                       lower_bound=10)
  flags.DEFINE_float("confidence", scaling_laws.DEFAULT_CONFIDENCE,
                     "Coverage of the bootstrap intervals.", lower_bound=0.5, upper_bound=0.999)
  flags.DEFINE_integer("seed", 0, "Seed of the bootstrap resampling.")
  flags.mark_flag_as_required("runs")


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  families = scaling_fit.read_runs(FLAGS.runs, FLAGS.metric)
  approaches = ("1", "2", "3") if FLAGS.approach == "all" else (FLAGS.approach,)
  out, isoflop, parametric = {}, {}, {}
  for family, runs in families.items():
    target = FLAGS.target_flops or float(runs.flops.max())
    results = scaling_fit.analyse(runs, approaches, target, FLAGS.replicates, FLAGS.confidence,
                      FLAGS.seed)
    if all(isinstance(fit, str) for fit in results.values()):
      raise UserError(f"{family}: no approach could be fitted: " + "; ".join(
          f"approach {k}: {v}" for k, v in results.items()))
    if isinstance(results.get("2"), scaling_laws.FrontierFit):
      isoflop[family] = results["2"]
    if isinstance(results.get("3"), scaling_laws.ParametricFit):
      parametric[family] = results["3"]
    out[family] = {f"approach_{k}": ({"error": v} if isinstance(v, str) else v.to_json())
                   for k, v in results.items()}
    out[family]["runs"] = len(runs.params)
    if not FLAGS.json:
      print(scaling_fit.results_markdown(family, results, FLAGS.confidence) + "\n")
  if FLAGS.plots:
    paths = scaling_fit.write_plots(families, isoflop, parametric, FLAGS.plots, FLAGS.metric)
    if not FLAGS.json:
      print("plots: " + ", ".join(sorted(paths.values())))
  if FLAGS.json:
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
  define_flags()
  cli.run(main)
