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

import dataclasses
import os
import tokenize
from typing import Any, Callable, Sequence, TypeVar

import gin
import jax

from model.config import ModelConfig
from model.scan.engine import ScanOptions
from pretrain.checkpointing import CheckpointConfig
from pretrain.data import pipeline as pipeline_lib
# Data tasks register their Gin configurables where they are defined.
from pretrain.data import synthetic, tasks, vocabularies  # pylint: disable=unused-import
from pretrain.errors import UserError, usage_error
from pretrain.optimizer import OptimizerConfig
from pretrain.runtime import Runtime
from pretrain.trainer import TrainConfig
from sharding.distributed import initialize_from_environment
from sharding.mesh import MeshConfig
from sharding.partition import ReplicationCheck
from sharding.rules import logical_axis_rules

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEARCH_ROOTS = (REPO_ROOT, os.path.join(REPO_ROOT, "configs"))

T = TypeVar("T")

# The plain configs and functions Gin may bind, registered here rather than where they
# are defined, so that library code constructing one never reads Gin.
_CONFIGURABLES = {
    target: gin.external_configurable(target, module=target.__module__)
    for target in (ModelConfig, ScanOptions, MeshConfig, ReplicationCheck,
                   CheckpointConfig, OptimizerConfig, TrainConfig, logical_axis_rules,
                   initialize_from_environment)
}


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


def parse(files: Sequence[str], bindings: Sequence[str], skip_unknown: bool = False) -> None:
  """Clears Gin, then parses `files` and `bindings`; a bad one is a usage error.

  `skip_unknown` ignores bindings of configurables not registered here (reading a
  run's `config.gin` for one value, whatever else the run bound).
  """
  gin.clear_config()
  for root in SEARCH_ROOTS:
    if root not in gin.config._LOCATION_PREFIXES:  # pylint: disable=protected-access
      gin.add_config_file_search_path(root)
  check_files(files)
  try:
    gin.parse_config_files_and_bindings(list(files), list(bindings),
                                        finalize_config=False, skip_unknown=skip_unknown)
  except (IOError, ValueError, SyntaxError, KeyError, TypeError, NameError,
          tokenize.TokenError) as error:
    raise usage_error(f"Bad Gin configuration: {_first_line(error)}"
                      f"{_gin_context(error)}") from error


def build(target: Callable[..., T], *args: Any, **kwargs: Any) -> T:
  """Calls `target` with its Gin bindings; a rejected value is a usage error.

  `target` is a plain config class or function registered above (the result is a plain
  instance), or a configurable decorated where it is defined (the data pipeline).
  Configs validate their fields in the constructor (ValueError/TypeError), and Gin
  raises RuntimeError for a required binding that is missing; at start-up all of them
  mean the configuration is wrong. UserErrors (e.g. an empty corpus) pass unchanged.
  """
  try:
    value = _CONFIGURABLES.get(target, target)(*args, **kwargs)
  except UserError:
    raise
  except (ValueError, TypeError, RuntimeError) as error:
    raise usage_error(f"Bad configuration value: {_first_line(error)}"
                      f"{_gin_context(error)}") from error
  if isinstance(target, type) and dataclasses.is_dataclass(target):
    value = dataclasses.replace(value)  # a plain instance of the class itself
  return value


def build_model_config() -> ModelConfig:
  """ModelConfig with its scan options, both as bound (`ScanOptions.lax_unroll = 16`)."""
  return build(ModelConfig, scan=build(ScanOptions))


def build_runtime(model_config: ModelConfig) -> Runtime:
  """The Runtime of `model_config` over the bound mesh, rules and replication check.

  A mesh that does not divide the devices, or a rule table that leaves a large
  parameter replicated, is a configuration error (ValueError from `sharding`).
  """
  mesh_config = build(MeshConfig)
  rules = build(logical_axis_rules)
  replication_check = build(ReplicationCheck)
  try:
    return Runtime.create(model_config, mesh_config, rules, replication_check)
  except ValueError as error:
    raise usage_error(f"Bad sharding configuration: {_first_line(error)}") from error


def build_pipeline(train_config: TrainConfig, runtime: Runtime) -> Any:
  """The Gin-configured `DataPipeline`, feeding this process's rows of each batch.

  Batch size, sequence length and seed come from `TrainConfig`, so the model and the
  data can never disagree on them.
  """
  rows = runtime.process_batch_rows(train_config.batch_size)
  count, index = jax.process_count(), jax.process_index()
  per_process = train_config.batch_size // count
  if rows != slice(index * per_process, (index + 1) * per_process):
    raise usage_error(
        f"The mesh gives process {index} batch rows {rows.start}:{rows.stop}, but the "
        f"data pipeline feeds rows {index * per_process}:{(index + 1) * per_process}; "
        "order the mesh so the batch axes split processes evenly")
  return build(pipeline_lib.DataPipeline, sequence_length=train_config.sequence_length,
               batch_size=train_config.batch_size, seed=train_config.seed,
               process_index=index, process_count=count)


def operative_config() -> str:
  """The bindings the run actually used, as written to `workdir/config.gin`."""
  return gin.operative_config_str()
