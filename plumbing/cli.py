"""Command-line plumbing shared by every command: absl flags, Gin flags, one-line errors.

Every `python -m pretrain.<command>` and `launch.<command>`, and every
`benchmarks/*.py`, runs its `main` through `run`. A `UserError` (see `plumbing.errors`)
becomes one line on stderr and its exit code; anything else is a bug and keeps its
traceback. `--traceback` shows the stack of a UserError too. `--help` (or `-h`) lists
the command's own flags and the shared ones; `--verbose` shows the third-party logs
that `plumbing.quiet` hides. `kill -USR2 PID` makes a running command print every
thread's Python stack to stderr and go on: how to see where a process that seems hung
waits (a collective, a storage call, a lock) without stopping it.
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import sys
from typing import Callable, Optional, Sequence

from absl import app
from absl import flags
from absl import logging

from plumbing import quiet
from plumbing import storage
from plumbing.errors import EXIT_USAGE, StorageOutageStop, UserError, usage_error

flags.DEFINE_bool("traceback", False, "Show the full Python traceback of a failure.")
flags.DEFINE_bool("verbose", False, "Show third-party logs (TensorFlow, XLA, Orbax, "
                  "gloo start-up lines) and INFO logging, which are hidden by default.")

# Flags of these packages are listed by a command's --help (absl lists only the flags
# of the main module unless others are declared key flags of it).
_OWN_PACKAGES = ("plumbing", "sharding", "model", "pretrain", "launch", "benchmarks")
_HELP_FLAGS = {"--help", "--helpshort", "--helpfull", "--helpxml", "-?"}


def define_gin_flags() -> None:
  """--gin_file / --gin_param, for commands configured through Gin."""
  flags.DEFINE_multi_string(
      "gin_file", [], "Gin config file (repeatable; later files override earlier "
      "ones). Relative paths are also looked up from the repository root.")
  flags.DEFINE_multi_string(
      "gin_param", [], "Gin binding applied after the files, e.g. "
      "--gin_param=TRAIN_STEPS=100 (repeatable).")


def require_gin_files() -> None:
  """--gin_file must be given at least once (a multi-flag's default is [], so absl's
  `mark_flag_as_required` cannot tell)."""
  flags.register_validator("gin_file", bool, message="--gin_file is required "
                           "(e.g. --gin_file=configs/quickstart.gin)")


def _list_shared_flags_in_help() -> None:
  """Makes the flags defined in shared modules (this one, launch.clusters.common) key flags of
  the main module, which is what absl's --help lists."""
  main = sys.argv[0]
  for module, module_flags in flags.FLAGS.flags_by_module_dict().items():
    if module != main and module.split(".")[0] in _OWN_PACKAGES:
      for flag in module_flags:
        flags.FLAGS.register_key_flag_for_module(main, flag)


def prepare_workdir(workdir: str) -> None:
  """Creates `workdir` (a path or a gs:// / s3:// URL) and proves it writable, before any
  compute starts."""
  storage.check_writable(workdir)


def reject_extra_arguments(argv: Sequence[str]) -> None:
  """Raises a usage error for positional arguments a command does not take."""
  if len(argv) > 1:
    raise usage_error(f"Unexpected arguments {list(argv[1:])}; every option is a --flag")


def _flags_parser(argv: list[str]) -> list[str]:
  """absl's flag parsing with a bad flag reported as one line and exit code 2, `-h` for
  `--help`, and help exiting 0 (absl exits 1 after printing it)."""
  own = argv.index("--") if "--" in argv else len(argv)  # a launcher's command follows
  argv = ["--help" if arg == "-h" and i < own else arg for i, arg in enumerate(argv)]
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    print(f"error: {error} (--help lists the flags)", file=sys.stderr)
    sys.exit(EXIT_USAGE)
  except SystemExit as done:
    if done.code == 1 and _HELP_FLAGS.intersection(argv[:own]):
      sys.exit(0)
    raise


def _skip_jax_shutdown_barrier() -> None:
  """Takes JAX's exit handler (`jax._src.api.clean_up`: no public way) off atexit. It
  ends the distributed runtime with a barrier every process must reach, and a process
  that stops alone (its storage outage seen by it only) would wait there for processes
  still waiting for it in the next step's collectives, until their hang watchdog ends
  them (20 s in a chaos run). Its launcher then stops the others at once."""
  api = sys.modules.get("jax._src.api")
  clean_up = getattr(api, "clean_up", None)
  if clean_up is not None:
    atexit.unregister(clean_up)


def run(main: Callable[[Sequence[str]], Optional[int]]) -> None:
  """absl `app.run(main)`, with a UserError reported in one line and its exit code."""
  def guarded(argv: Sequence[str]) -> Optional[int]:
    if flags.FLAGS.verbose:
      logging.set_verbosity(logging.INFO)
    elif not flags.FLAGS["verbosity"].present:
      # Orbax and JAX log every save at INFO; the commands print their own progress.
      logging.set_verbosity(logging.WARNING)
      quiet.install_log_filters()
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    try:
      return main(argv)
    except KeyboardInterrupt:
      print("interrupted", file=sys.stderr)
      sys.exit(130)
    except UserError as error:
      if flags.FLAGS.traceback:
        raise
      print(f"error: {str(error).strip() or type(error).__name__}", file=sys.stderr)
      if isinstance(error, StorageOutageStop):
        # Threads still write to the storage that does not answer, and an ordinary exit
        # joins them: exit as usual (atexit handlers, the stderr filter's drain among
        # them), less that join and JAX's shutdown barrier.
        sys.stdout.flush()
        sys.stderr.flush()
        _skip_jax_shutdown_barrier()
        atexit._run_exitfuncs()   # pylint: disable=protected-access
        os._exit(error.exit_code)   # pylint: disable=protected-access
      sys.exit(error.exit_code)

  _list_shared_flags_in_help()
  app.run(guarded, flags_parser=_flags_parser)
