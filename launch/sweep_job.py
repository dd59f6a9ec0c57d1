"""Runs one training run of a study and records how it ended in the run's directory.

  python -m launch.sweep_job --run_dir=DIR -- python -m pretrain.train ... --workdir=DIR

Every backend of `launch.sweep` starts its runs through this wrapper, so a run's own
directory (local, `gs://` or `s3://`, through `plumbing.storage`) says what became of it wherever it
ran: `sweep_status.json` holds `{"state": "running", "host", "pid", "failures"}` while
the command runs and `{"state": "exited", "exit_code", "failures"}` after it, where
`failures` counts the attempts that failed (exit code other than 0 and not a
preemption). Whether the run is finished is read from its metrics (`launch.sweeps.sweep_results`).
In a multi-process job only process 0 (SLURM_PROCID, TPU_WORKER_ID or
JOB_COMPLETION_INDEX) writes; the others just run the command.
"""
from __future__ import annotations

import sys
from typing import Sequence

from absl import flags

from launch.clusters import common
from launch.dispatch import sweep_job
from plumbing import cli


FLAGS = flags.FLAGS


def define_flags() -> None:
  common.stop_flags_at_command()
  flags.DEFINE_string("run_dir", None, "The run's directory (its --workdir).")
  flags.mark_flag_as_required("run_dir")


def main(argv: Sequence[str]) -> None:
  code = sweep_job.run(common.child_command(argv), FLAGS.run_dir)
  sys.exit(code if 0 <= code < 256 else 128 - code)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
