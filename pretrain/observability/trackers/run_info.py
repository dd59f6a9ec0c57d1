"""What a tracker's run is made of: the run's config, the model card's facts, and the
summary a session ends with.

The config is the operative Gin config the run wrote to `workdir/config.gin` (what
`python -m pretrain.train` used, every default included), read with Gin's own parser into
`Configurable.parameter` -> value, macro references replaced by the macros' values: the
same keys whatever file set them, so runs compare key by key. A run built without Gin
(library use) has no such file; its configs' fields stand in, under the same keys.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterable, Mapping, Optional

from gin import config_parser

from model import counting
from model.config import ModelConfig
from plumbing import storage
from pretrain.observability.trackers import EVAL, TRAIN, Row, RunInfo
from pretrain.run_directory import RunDirectory



class _Literals(config_parser.ParserDelegate):
  """Reads references as text (`@name`, `%MACRO`) instead of resolving them."""

  def configurable_reference(self, scoped_name: str, evaluate: bool) -> str:
    return f"@{scoped_name}{'()' if evaluate else ''}"

  def macro(self, name: str) -> str:
    return f"%{name}"


def parse_gin(text: str) -> dict[str, Any]:
  """`Configurable.parameter` (scoped: `scope/Configurable.parameter`; a macro: its
  name) -> its Python value, of an operative Gin config."""
  values: dict[str, Any] = {}
  for statement in config_parser.ConfigParser(text, _Literals()):
    if not isinstance(statement, config_parser.BindingStatement):
      continue
    key = ".".join(part for part in (statement.selector, statement.arg_name) if part)
    values[f"{statement.scope}/{key}" if statement.scope else key] = statement.value
  for key, value in values.items():
    if isinstance(value, str) and value.startswith("%") and value[1:] in values:
      values[key] = values[value[1:]]
  return values


def _fields(prefix: str, config: Any) -> dict[str, Any]:
  values = {}
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if dataclasses.is_dataclass(value):
      values.update(_fields(f"{prefix}.{field.name}", value))
    else:
      values[f"{prefix}.{field.name}"] = value
  return values


def run_config(workdir: str, configs: Iterable[Any] = ()) -> dict[str, Any]:
  """The run's config: `workdir/config.gin` parsed, or else the fields of `configs`
  (dataclass instances), keyed by class name."""
  path = RunDirectory(workdir).config
  if storage.exists(path):
    return parse_gin(storage.read_text(path))
  values: dict[str, Any] = {}
  for config in configs:
    values.update(_fields(type(config).__name__, config))
  return values


def model_facts(model: ModelConfig, *, sequence_length: int, batch_size: int,
                train_steps: int, flops_per_token: float) -> dict[str, Any]:
  """The facts a model card states about the model and the run's plan."""
  counts = counting.count_params(model)
  return {"model/params": counts.total, "model/params_non_embedding": counts.non_embedding,
          "model/flops_per_token": float(flops_per_token),
          "model/block_pattern": ",".join(model.block_pattern), "model/width": model.width,
          "model/depth": model.depth, "model/vocab_size": model.vocab_size,
          "run/sequence_length": sequence_length,
          "run/tokens_per_step": batch_size * sequence_length,
          "run/train_steps": train_steps}


def describe_run(workdir: str, group: Optional[str], configs: Iterable[Any],
                 facts: Mapping[str, Any]) -> RunInfo:
  """The run as trackers see it: named after the workdir's last component."""
  name = os.path.basename(workdir.rstrip("/")) or workdir
  return RunInfo(name, group, run_config(workdir, configs), dict(facts))


class Finals:
  """The last values a run logged, for its summary: fed every row, in order."""

  def __init__(self):
    self._last: dict[str, float] = {}
    self._steps = 0

  def add(self, row: Row) -> None:
    if row.kind == TRAIN:
      self._steps = max(self._steps, row.step)
      fields = ("loss",)
    elif row.kind == EVAL:
      fields = ("eval_loss", "eval_bits_per_byte")
    else:
      return
    for field in fields:
      if isinstance(row.values.get(field), (int, float)):
        self._last[f"final/{field}"] = float(row.values[field])

  def summary(self, facts: Mapping[str, Any]) -> dict[str, Any]:
    """`facts`, the steps and tokens trained so far and the last losses."""
    summary = dict(facts)
    summary["run/steps"] = self._steps
    if "run/tokens_per_step" in facts:
      summary["run/tokens"] = self._steps * facts["run/tokens_per_step"]
    summary.update(self._last)
    return summary
