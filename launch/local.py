"""Runs N cooperating JAX processes on this machine, each a simulated multi-device host.

  python -m launch.local --num_processes=2 --devices_per_process=4 -- \
      python -m pretrain.train --gin_file=configs/quickstart.gin --workdir=/tmp/run

Each process gets the coordinator address, process count and id in its environment
(see `sharding.distributed`), runs on CPU with `--devices_per_process` simulated devices,
and talks to the others over gloo: the same code path as a real multi-host job. Output
lines are prefixed with the process index. If any process fails, the others are stopped
and the launcher names the process that failed first; with `--max_restarts=N` it then
starts all of them again (at most N times, backing off from `--restart_backoff_s` when
attempts keep failing at once), and exits non-zero only when the budget is spent.
"""
from __future__ import annotations

import sys
from typing import Sequence

from absl import flags

from launch.clusters import common
from launch.clusters import local
from plumbing import cli


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Command-line flags, defined only when run as a program (see tests/test_entry_points)."""
  common.stop_flags_at_command()
  flags.DEFINE_integer("num_processes", None, "Processes (simulated hosts) to start.",
                       lower_bound=1)
  flags.DEFINE_integer("devices_per_process", 1, "Simulated CPU devices in each process.",
                       lower_bound=1)
  flags.DEFINE_integer("port", None, "Coordinator port on 127.0.0.1 (default: a free one).",
                       lower_bound=1, upper_bound=65535)
  flags.DEFINE_integer("max_restarts", 0, "Restart every process this many times at most "
                       "after one fails (the trainer resumes from its newest checkpoint).",
                       lower_bound=0)
  flags.DEFINE_float("restart_backoff_s", 1.0, "Pause before the first restart; it doubles "
                     "with each attempt in a row that failed within 60 s (at most 60 s), so "
                     "a failure that repeats at once (storage still down) does not spend the "
                     "budget in seconds. 0: restart at once.", lower_bound=0.0)
  flags.mark_flag_as_required("num_processes")


def main(argv: Sequence[str]) -> None:
  command = common.child_command(argv)
  sys.exit(local.run(command, FLAGS.num_processes, FLAGS.devices_per_process, FLAGS.port,
               FLAGS.max_restarts, FLAGS.restart_backoff_s))


if __name__ == "__main__":
  define_flags()
  cli.run(main)
