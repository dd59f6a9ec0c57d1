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
import difflib
import inspect
import os
import re
import sys
import tokenize
from typing import Any, Callable, Sequence, TypeVar

import gin
import jax

from model.config import ModelConfig
from model.attention_options import AttentionOptions
from model.scan.engine import ScanOptions
from pretrain.checkpoints import checkpointer, outage
from pretrain.checkpoints.checkpointer import CheckpointConfig
from pretrain.data import pipeline as pipeline_lib
# Data tasks register their Gin configurables where they are defined.
from plumbing.errors import UserError, usage_error
from pretrain.data import synthetic, tasks, vocabularies  # pylint: disable=unused-import
from pretrain.optimizer import OptimizerConfig
from pretrain.checkpoints.outage import StorageConfig
from pretrain.runtime import Runtime
from pretrain.train_config import TrainConfig
from sharding import distributed
from sharding.distributed import initialize_from_environment
from sharding.mesh import MeshConfig
from sharding.partition import ReplicationCheck
from sharding.rules import logical_axis_rules

# A run directory's config.gin (Gin's operative config) repeats the import lines of the
# files it was parsed from. Runs written before `pretrain/` was arranged in wings import
# the checkpoint configurables by their old module paths; those names stay importable,
# so that `evaluate`, `extrapolation` and resume read such a run as they always did.
MOVED_MODULES = {"pretrain.checkpointing": checkpointer, "pretrain.outage": outage}
for _old_name, _module in MOVED_MODULES.items():
  sys.modules.setdefault(_old_name, _module)

# Bindings applied after --gin_param, one per line: shortens a documented command (the
# README test runs each one verbatim with TRAIN_STEPS=2) without changing its text.
EXTRA_BINDINGS_ENV = "GRIFFIN_EXTRA_GIN_PARAMS"

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEARCH_ROOTS = (REPO_ROOT, os.path.join(REPO_ROOT, "configs"))

T = TypeVar("T")

# The plain configs and functions Gin may bind, registered here rather than where they
# are defined, so that library code constructing one never reads Gin.
_CONFIGURABLES = {
    target: gin.external_configurable(target, module=target.__module__)
    for target in (ModelConfig, ScanOptions, AttentionOptions, MeshConfig, ReplicationCheck,
                   CheckpointConfig, StorageConfig, OptimizerConfig, TrainConfig,
                   logical_axis_rules, initialize_from_environment)
}


def _never_raises(exists: Callable[[str], bool]) -> Callable[[str], bool]:
  def checked(path: str) -> bool:
    try:
      return exists(path)
    except (TypeError, ValueError, ImportError):
      return False
  return checked


# Gin's second file reader looks a relative path up as a Python package resource, and
# crashes (TypeError) on `configs/...` from outside the repository root, because
# `configs` is then an importable namespace package without a file; it should just
# report "not here" so the search goes on to the roots above.
gin.config._FILE_READERS[:] = [  # pylint: disable=protected-access
    (reader, _never_raises(exists))
    for reader, exists in gin.config._FILE_READERS]  # pylint: disable=protected-access


def _first_line(error: BaseException) -> str:
  text = str(error).strip() or type(error).__name__
  return text.splitlines()[0]


def _gin_context(error: BaseException) -> str:
  """Gin appends '  In file "F", line N' / '  In call to configurable ...' lines."""
  lines = [line.strip() for line in str(error).splitlines()[1:]]
  context = [line for line in lines if line.startswith(("In file", "In bindings",
                                                        "In call to configurable"))]
  return f" ({'; '.join(context)})" if context else ""


def _did_you_mean(name: str, known: Sequence[str]) -> str:
  close = difflib.get_close_matches(name, sorted(set(known)), n=1, cutoff=0.75)
  return f"; did you mean {close[0]}?" if close else ""


def _minimal(selector: str) -> str:
  return gin.config._REGISTRY.minimal_selector(selector)  # pylint: disable=protected-access


def _suggestion(message: str) -> str:
  """The nearest known name for Gin's "unknown configurable / parameter" errors."""
  registry = gin.config._REGISTRY  # pylint: disable=protected-access
  unknown_parameter = re.match(
      r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", message)
  if unknown_parameter:
    configurable = registry.get_match(unknown_parameter.group(1))
    if configurable is not None:
      known = inspect.signature(configurable.wrapped).parameters
      return _did_you_mean(unknown_parameter.group(2), list(known))
  unknown_configurable = re.match(r"No configurable matching '([^']+)'", message)
  if unknown_configurable:
    known = [_minimal(selector) for selector, _ in registry.items()]
    return _did_you_mean(unknown_configurable.group(1).rsplit("/", 1)[-1], known)
  return ""


def _bindings() -> dict[tuple[str, str], dict[str, Any]]:
  return gin.config._CONFIG  # pylint: disable=protected-access


def _macros_defined() -> set[str]:
  return {scope for scope, selector in _bindings() if selector == "gin.macro"}


def _macros_referenced() -> set[str]:
  macro = gin.config.get_configurable(gin.config.macro)
  return {reference.scoped_selector.rsplit("/", 1)[0]
          for reference in gin.config.iterate_references(_bindings(), to=macro)}


def check_macros() -> None:
  """Every macro set is read somewhere, and every macro read is set.

  A macro nothing refers to is almost always a typo (`TRAIN_STEP=20` for TRAIN_STEPS),
  which Gin would otherwise accept silently and run with the default.
  """
  defined, referenced = _macros_defined(), _macros_referenced()
  unread, unset = sorted(defined - referenced), sorted(referenced - defined)
  if unread:
    raise usage_error(f"Gin macro {unread[0]} is set but nothing reads it"
                      f"{_did_you_mean(unread[0], referenced)}")
  if unset:
    raise usage_error(f"Gin macro {unset[0]} is read but never set; add "
                      f"--gin_param={unset[0]}=... or the Gin file that sets it"
                      f"{_did_you_mean(unset[0], defined)}")


def _bound(selector: str, parameter: str) -> bool:
  try:
    gin.query_parameter(f"{selector}.{parameter}")
  except ValueError:
    return False
  return True


# What a training run needs besides a model, and the Gin file that provides it.
_TRAINING_PARTS = (
    ("ModelConfig", "width", "No model configuration: add a preset, e.g. "
     "--gin_file=configs/models/griffin_100m.gin (see configs/models/)"),
    ("TrainConfig", "train_steps", "No trainer configuration: add "
     "--gin_file=configs/base/trainer.gin (it defines TRAIN_STEPS, BATCH_SIZE, "
     "SEQUENCE_LENGTH, ...) and --gin_file=configs/base/optimizer.gin"),
    ("DataPipeline", "task", "No data configuration: add one of configs/data/*.gin, e.g. "
     "--gin_file=configs/data/text_files.gin --gin_param=\"TRAIN_FILES='corpus/*.txt'\""),
)


def check_training_config() -> None:
  """A training run has a model, trainer and data config, and no macro typos.

  Called right after `parse`, before anything is built, so a missing Gin file is one
  line naming the file to add rather than a failure deep inside the data pipeline.
  """
  for selector, parameter, message in _TRAINING_PARTS:
    if not _bound(selector, parameter):
      raise usage_error(message)
  check_macros()
  check_bindings_reachable(TRAINING_ROOTS)


# What `pretrain.train` builds from Gin; with what their bindings reference, every
# binding of a training config must be read by one of them.
TRAINING_ROOTS = (initialize_from_environment, TrainConfig, ModelConfig, ScanOptions,
                  AttentionOptions,
                  MeshConfig, logical_axis_rules, ReplicationCheck, CheckpointConfig,
                  StorageConfig, OptimizerConfig, pipeline_lib.DataPipeline)


def unreachable_bindings(roots: Sequence[Callable[..., Any]]) -> list[str]:
  """Bindings and macros that nothing built from `roots` can read, without building.

  Follows references (`@task()`, `%MACRO`) out from the bindings of `roots`; whatever
  is left configures something the command never calls. Checked right after parsing,
  so a leftover binding fails before any data is prepared or anything is compiled.
  """
  bindings = _bindings()
  registry = gin.config._REGISTRY  # pylint: disable=protected-access
  wrapped = [_CONFIGURABLES.get(root, root) for root in roots]
  root_selectors = {configurable.selector for _, configurable in registry.items()
                    if configurable.wrapped in roots or configurable.wrapper in wrapped}
  frontier = [key for key in bindings if key[1] in root_selectors]
  reached: set[tuple[str, str]] = set()
  while frontier:
    key = frontier.pop()
    if key in reached or key not in bindings:
      continue
    reached.add(key)
    for reference in gin.config.iterate_references(bindings[key]):
      frontier += [reference.config_key, ("", reference.configurable.selector)]
  return sorted(_binding_name(key) for key in bindings if key not in reached)


def _binding_name(key: tuple[str, str]) -> str:
  scope, selector = key
  if selector == "gin.macro":
    return f"macro {scope}"
  return f"{scope + '/' if scope else ''}{_minimal(selector)}"


def check_bindings_reachable(roots: Sequence[Callable[..., Any]] = TRAINING_ROOTS) -> None:
  """A usage error naming the first binding nothing built from `roots` reads."""
  unreachable = unreachable_bindings(roots)
  if unreachable:
    raise usage_error(f"Gin bindings of {unreachable[0]} are set but this command never "
                      "reads them (a leftover of another config?); remove them")


def check_bindings_used() -> None:
  """Every binding was read by a configurable this command built.

  Call after everything is built: Gin records in its operative config the bindings a
  call actually used, so a binding missing there configures something this run never
  builds (a leftover of another data config) or that the caller sets itself.
  """
  operative = gin.config._OPERATIVE_CONFIG  # pylint: disable=protected-access
  unused = [(scope, selector, parameter)
            for (scope, selector), parameters in _bindings().items()
            for parameter in parameters
            if parameter not in operative.get((scope, selector), {})]
  if not unused:
    return
  # A macro is unused when only unused bindings read it: name the binding.
  scope, selector, parameter = min(unused, key=lambda u: u[1] == "gin.macro")
  if selector == "gin.macro":
    raise usage_error(f"Gin macro {scope} is set but nothing this run builds reads it; "
                      "remove it")
  name = f"{scope + '/' if scope else ''}{_minimal(selector)}.{parameter}"
  raise usage_error(f"Gin binding {name} is set but this run never reads it (nothing "
                    "calls it, or the trainer sets that value itself); remove it")


def check_files(files: Sequence[str]) -> None:
  """Raises a usage error naming the first Gin file found nowhere on the search path."""
  for path in files:
    if not os.path.exists(path) and not any(
        os.path.exists(os.path.join(root, path)) for root in SEARCH_ROOTS):
      raise usage_error(f"Gin file not found: {path}")


def extra_bindings() -> list[str]:
  """The bindings of `EXTRA_BINDINGS_ENV`, which `train` and `data.prepare` apply after
  their --gin_param."""
  return [binding for binding in os.environ.get(EXTRA_BINDINGS_ENV, "").splitlines()
          if binding.strip()]


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
                      f"{_gin_context(error)}{_suggestion(_first_line(error))}") from error


def build(target: Callable[..., T], *args: Any, **kwargs: Any) -> T:
  """Calls `target` with its Gin bindings; a rejected value is a usage error.

  `target` is a plain config class or function registered above (the result is a plain
  instance), or a configurable decorated where it is defined (the data pipeline).
  Configs validate their fields in the constructor (ValueError/TypeError), and Gin
  raises RuntimeError for a required binding that is missing; at start-up all of them
  mean the configuration is wrong. UserErrors (e.g. an empty corpus) pass as their own
  one line, without the call context Gin appends to them.
  """
  try:
    value = _CONFIGURABLES.get(target, target)(*args, **kwargs)
  except UserError as error:
    # Gin re-raises a proxy whose message adds "In call to configurable ..." lines; the
    # exception it wraps is the proxy's context.
    original = error.__context__
    if isinstance(original, UserError) and str(error).startswith(str(original)):
      raise original from None
    raise
  except (ValueError, TypeError, RuntimeError) as error:
    raise usage_error(f"Bad configuration value: {_first_line(error)}"
                      f"{_gin_context(error)}") from error
  if isinstance(target, type) and dataclasses.is_dataclass(target):
    value = dataclasses.replace(value)  # a plain instance of the class itself
  return value


def build_model_config() -> ModelConfig:
  """ModelConfig with its scan and attention options, all as bound
  (`ScanOptions.lax_unroll = 16`, `AttentionOptions.impl = "xla"`)."""
  return build(ModelConfig, scan=build(ScanOptions), attention=build(AttentionOptions))


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
               process_index=index, process_count=count,
               build_missing=distributed.processes_on_one_machine(),
               open_validation=bool(train_config.eval_every or train_config.final_eval))


def data_bindings() -> dict[str, Any]:
  """The bound `DataPipeline` arguments with references evaluated (so `@text_files_task()`
  registers its SeqIO task and gives its name), for `pretrain.data.prepare`, which
  prepares the stores a training config reads without building the pipeline."""
  if not _bound("DataPipeline", "task"):
    raise usage_error(_TRAINING_PARTS[2][2])
  try:
    return gin.get_bindings(pipeline_lib.DataPipeline)
  except UserError:
    raise
  except (ValueError, TypeError, RuntimeError) as error:
    raise usage_error(f"Bad data configuration: {_first_line(error)}"
                      f"{_gin_context(error)}") from error


def operative_config() -> str:
  """The bindings the run actually used, as written to `workdir/config.gin`."""
  return gin.operative_config_str()
