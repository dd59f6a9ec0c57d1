"""Starts a cooldown fork from its stable run's checkpoint, then runs its training.

  python -m launch.fork --source=STABLE_RUN_DIR --step=S --workdir=FORK_DIR -- \
      python -m pretrain.train ... --workdir=FORK_DIR

A forked (WSD) study (`launch.sweeps.wsd_design`) trains each size once at a constant learning
rate and forks a cooldown from that run's checkpoint of step S. The fork is an ordinary
run of the study: before its first attempt this copies checkpoint S of the stable run
into the fork's own `checkpoints/`, and the trainer then resumes from it as from any
checkpoint (parameters, optimizer state with its step count, RNG), so the WSD schedule,
a function of the global step, continues exactly. Every later attempt finds the fork's
own checkpoints and copies nothing. Being part of the command, the dependency on the
stable checkpoint travels with the run to every backend: a fork started before its
source exists stops with one line naming it.
"""
from __future__ import annotations

import os
from typing import Sequence

from absl import flags

from launch.clusters import common
from launch.sweeps import fork
from plumbing import cli


FLAGS = flags.FLAGS


def define_flags() -> None:
  common.stop_flags_at_command()
  flags.DEFINE_string("source", None, "The stable run's directory.")
  flags.DEFINE_integer("step", None, "The stable checkpoint's step.", lower_bound=1)
  flags.DEFINE_string("workdir", None, "The fork's directory (its --workdir).")
  for name in ("source", "step", "workdir"):
    flags.mark_flag_as_required(name)


def main(argv: Sequence[str]) -> None:
  command = common.child_command(argv)
  if fork.seed(FLAGS.source, FLAGS.step, FLAGS.workdir):
    print(f"[fork] {FLAGS.workdir}: starts from step {FLAGS.step} of {FLAGS.source}",
          flush=True)
  os.execvp(command[0], command)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
