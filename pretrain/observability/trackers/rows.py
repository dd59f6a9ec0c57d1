"""`metrics.jsonl` rows as tracker rows, and the stable metric names W&B and MLflow use.

The names (one scheme for both trackers, so a dashboard moves between them):
  train/<field>             a training row's fields: train/loss, train/learning_rate, ...
  eval/<field>              an evaluation row's, `eval_` dropped: eval/loss, eval/tokens,
                            eval/bits_per_byte
  downstream/<task>/<metric> as written
  <kind>/<field>            a record's numeric fields (goodput/productive_s,
                            restart/lost_steps, straggler/deviation, ...), a list's items
                            as <kind>/<field>/<i>, and the record's own step as
                            <kind>/step (its place on a tracker's step axis may be later)
TensorBoard keeps the names `metrics.jsonl` uses, as before trackers existed.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from pretrain.observability.trackers import DOWNSTREAM, EVAL, STEP_KINDS, TRAIN, Row

_EVAL_PREFIX = "eval_"
_DOWNSTREAM_PREFIX = "downstream/"


def row_kind(row: Mapping[str, Any]) -> str:
  """The kind of a `metrics.jsonl` row: its `kind`, or which log call wrote it."""
  if "kind" in row:
    return str(row["kind"])
  if "loss" in row:
    return TRAIN
  if any(name.startswith(_DOWNSTREAM_PREFIX) for name in row):
    return DOWNSTREAM
  if any(name.startswith(_EVAL_PREFIX) for name in row):
    return EVAL
  return TRAIN


def from_json(row: Mapping[str, Any]) -> Row:
  """The tracker row of a `metrics.jsonl` row."""
  values = {name: value for name, value in row.items() if name not in ("kind", "step")}
  return Row(row_kind(row), int(row["step"]), values)


def _number(value: Any) -> float | None:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  return float(value) if math.isfinite(value) else None


def metric_names(row: Row) -> dict[str, float]:
  """The row's finite numbers under their stable names (module docstring); strings,
  None, NaN and infinities are left out."""
  named: dict[str, Any] = {}
  for field, value in row.values.items():
    if row.kind == TRAIN:
      name = f"train/{field}"
    elif row.kind == EVAL:
      name = f"eval/{field.removeprefix(_EVAL_PREFIX)}"
    elif row.kind == DOWNSTREAM:
      name = field
    else:
      name = f"{row.kind}/{field}"
    if isinstance(value, (list, tuple)):
      named.update({f"{name}/{i}": item for i, item in enumerate(value)})
    else:
      named[name] = value
  if row.kind not in STEP_KINDS:
    named[f"{row.kind}/step"] = row.step
  return {name: number for name, value in named.items()
          if (number := _number(value)) is not None}
