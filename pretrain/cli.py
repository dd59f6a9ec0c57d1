"""Shared command-line plumbing: Gin flags, config parsing and one-line error reports.

Every `python -m pretrain.<command>` runs its `main` through `run`, which turns the
errors a user can fix (a missing Gin file, an unknown binding, a bad value, an empty
corpus, a checkpoint of another model, an unwritable workdir) into a short message on
stderr and a non-zero exit code instead of a stack trace:

  exit 2  the command line or Gin configuration is wrong (nothing was run)
  exit 1  the run failed (data, checkpoint, divergence, file-system problems)

`--traceback` shows the full stack for debugging.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

from absl import app
from absl import logging
from absl import flags

# TensorFlow (imported by SeqIO) otherwise prints start-up notices on every command.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

flags.DEFINE_bool("traceback", False, "Show the full Python traceback of a failure.")


class UserError(Exception):
  """A failure the user can fix; reported as a message, not a traceback."""
  exit_code = 1


class ConfigError(UserError):
  """The Gin configuration or the command line is wrong."""
  exit_code = 2


def define_gin_flags() -> None:
  """--gin_file / --gin_param, for commands configured through Gin."""
  flags.DEFINE_multi_string(
      "gin_file", [], "Gin config file (repeatable; later files override earlier "
      "ones). Relative paths are also looked up from the repository root.")
  flags.DEFINE_multi_string(
      "gin_param", [], "Gin binding applied after the files, e.g. "
      "--gin_param=TRAIN_STEPS=100 (repeatable).")


def import_configurables() -> None:
  """Imports every module whose Gin configurables a training config may bind."""
  # pylint: disable=g-import-not-at-top,unused-import
  import model.config
  import pretrain.checkpointing
  import pretrain.data.pipeline
  import pretrain.data.synthetic
  import pretrain.data.tasks
  import pretrain.data.vocabularies
  import pretrain.optimizer
  import pretrain.trainer
  import sharding.distributed
  import sharding.mesh
  import sharding.partition
  import sharding.rules


def _first_line(error: BaseException) -> str:
  text = str(error).strip() or type(error).__name__
  return text.splitlines()[0]


def _gin_context(error: BaseException) -> str:
  """Gin appends '  In file "F", line N' / '  In call to configurable ...' lines."""
  lines = [line.strip() for line in str(error).splitlines()[1:]]
  context = [line for line in lines if line.startswith(("In file", "In bindings",
                                                        "In call to configurable"))]
  return f" ({'; '.join(context)})" if context else ""


def _gin_search_roots() -> tuple[str, str]:
  return (REPO_ROOT, os.path.join(REPO_ROOT, "configs"))


def check_gin_files(files: Sequence[str]) -> None:
  """Raises ConfigError naming the first Gin file that exists nowhere on the search path."""
  for path in files:
    if not os.path.exists(path) and not any(
        os.path.exists(os.path.join(root, path)) for root in _gin_search_roots()):
      raise ConfigError(f"Gin file not found: {path}")


def parse_gin(files: Sequence[str], bindings: Sequence[str]) -> None:
  """Parses Gin files then bindings; raises ConfigError naming the bad file or binding.

  The repository root and its `configs/` folder are on Gin's search path, so
  `include 'configs/base/trainer.gin'` and `--gin_file=configs/quickstart.gin` work
  from any directory.
  """
  import gin  # pylint: disable=g-import-not-at-top
  for root in _gin_search_roots():
    if root not in gin.config._LOCATION_PREFIXES:  # pylint: disable=protected-access
      gin.add_config_file_search_path(root)
  check_gin_files(files)
  try:
    gin.parse_config_files_and_bindings(list(files), list(bindings),
                                        finalize_config=False)
  except (IOError, ValueError, SyntaxError, KeyError, TypeError, NameError) as error:
    raise ConfigError(f"Bad Gin configuration: {_first_line(error)}"
                      f"{_gin_context(error)}") from error


def _known_errors() -> tuple[type[BaseException], ...]:
  known: list[type[BaseException]] = [UserError]
  try:
    from pretrain.data import DataError  # pylint: disable=g-import-not-at-top
    known.append(DataError)
  except ImportError:
    pass
  return tuple(known)


def _report(error: BaseException) -> int:
  """Prints `error` briefly; returns the exit code."""
  if isinstance(error, UserError):
    # Written for the user; may list several items (e.g. mismatching parameters).
    print(f"error: {str(error).strip() or type(error).__name__}", file=sys.stderr)
    return error.exit_code
  one_line = f"{_first_line(error)}{_gin_context(error)}"
  if isinstance(error, _known_errors()):   # the data pipeline's DataError
    print(f"error: {one_line}", file=sys.stderr)
    return 1
  if isinstance(error, (ValueError, TypeError)) and "In call to configurable" in str(error):
    # A Gin-bound value rejected by its dataclass/function: the user's config is wrong.
    print(f"error: bad configuration value: {one_line}", file=sys.stderr)
    return 2
  print(f"error: {one_line}", file=sys.stderr)
  return 1


def run(main: Callable[[Sequence[str]], None]) -> None:
  """absl `app.run(main)` with user-fixable errors reported in a line or two."""
  def guarded(argv: Sequence[str]) -> None:
    if not flags.FLAGS["verbosity"].present:
      # Orbax and JAX log every save at INFO; the commands print their own progress.
      logging.set_verbosity(logging.WARNING)
    try:
      main(argv)
    except KeyboardInterrupt:
      print("interrupted", file=sys.stderr)
      sys.exit(130)
    except Exception as error:  # pylint: disable=broad-except
      if flags.FLAGS.traceback:
        raise
      known = isinstance(error, _known_errors()) or (
          isinstance(error, (ValueError, TypeError))
          and "In call to configurable" in str(error))
      if not known:
        raise
      sys.exit(_report(error))

  app.run(guarded)
