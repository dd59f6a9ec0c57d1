"""The one Gin loader of every command: search path, parsing, and building configs.

Gin is read only here and in the entry points that call this module. `parse` loads the
files and bindings; `build` calls a configurable once, at start-up, and the plain config
object it returns is what gets passed down. Library code never constructs a
configurable itself, so a jitted function's behaviour is fixed by its arguments, not by
bindings that change between calls.

The repository root and its `configs/` folder are on Gin's search path, so
`include 'configs/base/trainer.gin'` and `--gin_file=configs/quickstart.gin` work from
any directory.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence, TypeVar

import gin

# Every module that registers Gin configurables a config file may bind.
# pylint: disable=unused-import
import model.config
import model.scan.engine
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
# pylint: enable=unused-import
from pretrain.errors import usage_error

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEARCH_ROOTS = (REPO_ROOT, os.path.join(REPO_ROOT, "configs"))

T = TypeVar("T")


def _first_line(error: BaseException) -> str:
  text = str(error).strip() or type(error).__name__
  return text.splitlines()[0]


def _gin_context(error: BaseException) -> str:
  """Gin appends '  In file "F", line N' / '  In call to configurable ...' lines."""
  lines = [line.strip() for line in str(error).splitlines()[1:]]
  context = [line for line in lines if line.startswith(("In file", "In bindings",
                                                        "In call to configurable"))]
  return f" ({'; '.join(context)})" if context else ""


def check_files(files: Sequence[str]) -> None:
  """Raises a usage error naming the first Gin file found nowhere on the search path."""
  for path in files:
    if not os.path.exists(path) and not any(
        os.path.exists(os.path.join(root, path)) for root in SEARCH_ROOTS):
      raise usage_error(f"Gin file not found: {path}")


def parse(files: Sequence[str], bindings: Sequence[str]) -> None:
  """Clears Gin, then parses `files` and `bindings`; a bad one is a usage error."""
  gin.clear_config()
  for root in SEARCH_ROOTS:
    if root not in gin.config._LOCATION_PREFIXES:  # pylint: disable=protected-access
      gin.add_config_file_search_path(root)
  check_files(files)
  try:
    gin.parse_config_files_and_bindings(list(files), list(bindings),
                                        finalize_config=False)
  except (IOError, ValueError, SyntaxError, KeyError, TypeError, NameError) as error:
    raise usage_error(f"Bad Gin configuration: {_first_line(error)}"
                      f"{_gin_context(error)}") from error


def build(configurable: Callable[..., T], *args: Any, **kwargs: Any) -> T:
  """Calls a Gin configurable with its bindings; a rejected value is a usage error.

  Configs validate their fields in the constructor (ValueError/TypeError), and Gin
  raises RuntimeError for a required binding that is missing; at start-up all of them
  mean the configuration is wrong. UserErrors (e.g. an empty corpus) pass unchanged.
  """
  try:
    return configurable(*args, **kwargs)
  except (ValueError, TypeError, RuntimeError) as error:
    raise usage_error(f"Bad configuration value: {_first_line(error)}"
                      f"{_gin_context(error)}") from error


def operative_config() -> str:
  """The bindings the run actually used, as written to `workdir/config.gin`."""
  return gin.operative_config_str()
