r"""Trains a model, or resumes the run in --workdir.

  python -m pretrain.train --gin_file=configs/quickstart.gin --workdir=workdirs/quickstart
  python -m pretrain.train --gin_file=F --gin_param=TRAIN_STEPS=2000 --workdir=DIR

If DIR holds checkpoints the run continues from the newest complete one (same losses as
an uninterrupted run). SIGTERM saves a checkpoint at the next step boundary and exits 0;
run the same command again to resume. Exit codes: 0 done or preempted-and-saved,
1 the run failed (diverged, data or checkpoint problem), 2 bad command line or config.
"""
from __future__ import annotations

import os
import tempfile
from typing import Sequence

from absl import flags

from pretrain import cli

FLAGS = flags.FLAGS


def define_flags() -> None:
  cli.define_gin_flags()
  flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, config.gin.")


def check_writable(workdir: str) -> None:
  """Creates `workdir` and proves it writable, before any compute starts."""
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write_test"):
      pass
  except OSError as error:
    raise cli.UserError(f"Workdir {workdir} is not writable: {error.strerror or error}. "
                        "Choose another --workdir or fix its permissions.") from None


def write_config(workdir: str) -> None:
  """Writes the operative Gin config (only process 0)."""
  import gin  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "config.gin"), "w", encoding="utf-8") as f:
      f.write(gin.operative_config_str())


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise cli.ConfigError(f"Unexpected arguments {argv[1:]}; use --gin_file/--gin_param")
  if not FLAGS.workdir:
    raise cli.ConfigError("--workdir is required")
  if not FLAGS.gin_file:
    raise cli.ConfigError("--gin_file is required, e.g. --gin_file=configs/quickstart.gin")
  workdir = os.path.abspath(os.path.expanduser(FLAGS.workdir))
  cli.check_gin_files(FLAGS.gin_file)
  check_writable(workdir)
  cli.import_configurables()
  cli.parse_gin(FLAGS.gin_file, FLAGS.gin_param)
  from sharding import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize_from_environment()
  from pretrain import trainer  # pylint: disable=g-import-not-at-top
  trainer.train(workdir, on_ready=lambda: write_config(workdir))


if __name__ == "__main__":
  define_flags()
  cli.run(main)
