"""Command-line plumbing shared by every command: absl flags, Gin flags, one-line errors.

Every `python -m pretrain.<command>`, `launch.<command>`, `model.summary` and
`benchmarks/*.py` runs its `main` through `run`. A `UserError` (see `pretrain.errors`)
becomes one line on stderr and its exit code; anything else is a bug and keeps its
traceback. `--traceback` shows the stack of a UserError too.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Sequence

from absl import app
from absl import flags
from absl import logging

from pretrain.errors import EXIT_USAGE, UserError, usage_error

# TensorFlow (imported by SeqIO) otherwise prints start-up notices on every command.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

flags.DEFINE_bool("traceback", False, "Show the full Python traceback of a failure.")


def define_gin_flags() -> None:
  """--gin_file / --gin_param, for commands configured through Gin."""
  flags.DEFINE_multi_string(
      "gin_file", [], "Gin config file (repeatable; later files override earlier "
      "ones). Relative paths are also looked up from the repository root.")
  flags.DEFINE_multi_string(
      "gin_param", [], "Gin binding applied after the files, e.g. "
      "--gin_param=TRAIN_STEPS=100 (repeatable).")


def reject_extra_arguments(argv: Sequence[str]) -> None:
  """Raises a usage error for positional arguments a command does not take."""
  if len(argv) > 1:
    raise usage_error(f"Unexpected arguments {list(argv[1:])}; every option is a --flag")


def _flags_parser(argv: list[str]) -> list[str]:
  """absl's flag parsing with a bad flag reported as one line and exit code 2."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    print(f"error: {error}", file=sys.stderr)
    print(f"Run {os.path.basename(argv[0])} --helpfull for the flags.", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def run(main: Callable[[Sequence[str]], Optional[int]]) -> None:
  """absl `app.run(main)`, with a UserError reported in one line and its exit code."""
  def guarded(argv: Sequence[str]) -> Optional[int]:
    if not flags.FLAGS["verbosity"].present:
      # Orbax and JAX log every save at INFO; the commands print their own progress.
      logging.set_verbosity(logging.WARNING)
    try:
      return main(argv)
    except KeyboardInterrupt:
      print("interrupted", file=sys.stderr)
      sys.exit(130)
    except UserError as error:
      if flags.FLAGS.traceback:
        raise
      print(f"error: {str(error).strip() or type(error).__name__}", file=sys.stderr)
      sys.exit(error.exit_code)

  app.run(guarded, flags_parser=_flags_parser)
