r"""Plots of one or several runs from their `metrics.jsonl`, side by side.

  python -m pretrain.report --workdir=workdirs/quickstart --out=workdirs/quickstart/report
  python -m pretrain.report --workdir=A --workdir=B --out=DIR

writes into --out (PNG, matplotlib's Agg backend, no display needed):
  loss.png        training loss against step, one line per run
  eval_loss.png   validation loss against step
  throughput.png  tokens per second against step
  mfu.png         model FLOPs utilisation against step (absent values: the device's
                  peak is unknown, e.g. CPU; the panel says so)
  goodput.png     per run, the wall time of the whole run (all sessions) stacked by
                  category (`pretrain.observability.goodput`) against wall-clock time, with the
                  goodput % in the title
and prints the paths. A --workdir may be local, gs:// or s3://; --out is a local
directory. A workdir without metrics is a one-line error (exit 2).
"""
from __future__ import annotations

from typing import Sequence

from absl import flags

from plumbing import cli
from pretrain.observability.report import write_report

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_multi_string("workdir", None, "A run directory (repeat for several runs).")
  flags.DEFINE_string("out", None, "Directory for the PNG files.")
  flags.mark_flags_as_required(["workdir", "out"])


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  for path in write_report(FLAGS.workdir, FLAGS.out):
    print(path)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
