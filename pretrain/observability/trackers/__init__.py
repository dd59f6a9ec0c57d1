"""Experiment trackers: TensorBoard, Weights & Biases, MLflow, or a class of your own.

`metrics.jsonl` and the console are always written (`pretrain.observability.metrics.MetricsWriter`);
`TrainConfig.trackers` names the trackers that get the same rows besides, by their
registered names (`names()`: "tensorboard", "wandb", "mlflow" built in). A tracker is one
class implementing `Tracker`, registered with `register(cls)`; the built-ins are
registered by `pretrain.observability.trackers.delivery`, which runs them.

Why this shape: a tracker is someone else's service, so nothing it does may stop or slow
the run. Each tracker runs in a thread of its own (`delivery`), is told every row once,
in order, and may raise from any method: the row stays queued and is sent again when the
tracker answers, or by the next run in the workdir (which keeps each tracker's run id and
what it was sent in `trackers.json`), so a restarted run continues one tracker run and
every step reaches it once. Only process 0 has trackers.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Mapping, NamedTuple, Optional, Protocol, Sequence

from pretrain.checkpoints.outage import Uploads
from pretrain.data.mixing import RECORD_KIND as MIXTURE

# The kinds of rows: a step's metrics (`metrics.jsonl` rows without a `kind`) ...
TRAIN, EVAL, DOWNSTREAM = "train", "eval", "downstream"
STEP_KINDS = (TRAIN, EVAL, DOWNSTREAM)
# ... and session records (rows with a `kind`: `pretrain.observability.goodput`, `.stragglers`).
RECORD_KINDS = ("goodput", "restart", "straggler")
# The longest a session's end waits for a tracker call that has not answered, unless
# the run sets its own (`TrainConfig.tracker_exit_wait_s`).
EXIT_WAIT_S = 10.0
# Records that belong to one step (a mixture's token shares over the batches since the
# last one): a restart that trains their step again drops and rewrites them, as it does a
# step's metrics, and trackers get each step's once.
STEP_RECORD_KINDS = (MIXTURE,)


class Row(NamedTuple):
  """One `metrics.jsonl` row as trackers get it: its kind (`STEP_KINDS`, or the row's
  own `kind` for a record), its step, and its other fields as written (numbers, and in
  records also strings, lists and None)."""
  kind: str
  step: int
  values: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class TrackerContext:
  """What a tracker is built with, on process 0 before the run starts.

  Attributes:
    workdir: the run's directory (a path or a gs:// / s3:// URL).
    uploads: the background writer of a bucket workdir (`pretrain.checkpoints.outage.Uploads`);
      None on a local disk.
  """
  workdir: str
  uploads: Optional[Uploads] = None


@dataclasses.dataclass(frozen=True)
class RunInfo:
  """What a tracker's run is made of (`run_info.describe_run`).

  Attributes:
    name: the run's display name (the workdir's last component).
    group: the study the run belongs to (`TrainConfig.tracker_group`, which
      `launch.sweep` sets): a W&B group, an MLflow experiment; None: none.
    config: the operative Gin config, `Configurable.parameter` (or `MACRO`) -> value.
    facts: the model card's facts (`model/params`, `model/flops_per_token`, ...).
  """
  name: str
  group: Optional[str] = None
  config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  facts: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Tracker(Protocol):
  """One experiment tracker (see the module docstring). `__init__(context)` runs on the
  training thread; every other method on the tracker's own thread, in the order open,
  log..., close. Any exception means "not done": the rows are kept and offered again.

  Attributes:
    name: the name `TrainConfig.trackers` uses.
    where: after `open`, one line saying where to look at the run ("" for nothing).
    service (optional): the service it talks to and the setting that chooses it, for
      the warning when it does not answer ("the MLflow server at URL
      (MLFLOW_TRACKING_URI)"); without it, "the <name> service".
  """
  name: str
  where: str

  def open(self, run: RunInfo, run_id: Optional[str], last_step: int) -> Optional[str]:
    """Starts the tracker's run, or continues the one with `run_id` (what an earlier
    `open` in this workdir returned), which has got the step rows up to `last_step`
    (0: none); returns the run's id (None: the tracker has none)."""

  def log(self, rows: Sequence[Row]) -> None:
    """Sends rows, in order. None of them was sent before (a row of a step the
    tracker has already got is never offered again)."""

  def close(self, summary: Mapping[str, Any], failed: bool) -> None:
    """Records the run's summary (`facts` and the final losses) and ends this
    session's part of the run; `failed`: the session ended with an error."""


_TRACKERS: dict[str, Callable[[TrackerContext], Tracker]] = {}


def register(factory: Callable[[TrackerContext], Tracker]) -> Callable[[TrackerContext],
                                                                        Tracker]:
  """Adds a tracker class (anything with a `name` that builds a `Tracker` from a
  `TrackerContext`) under its `name`; returns it, so it can decorate the class.

  Raises:
    ValueError: the name is taken by another class.
  """
  name = factory.name  # type: ignore[attr-defined]
  taken = _TRACKERS.get(name)
  if taken is not None and taken is not factory:
    raise ValueError(f"tracker {name!r} is registered already ({taken!r})")
  _TRACKERS[name] = factory
  return factory


def unregister(name: str) -> None:
  """Removes a tracker (for tests that register one of their own)."""
  del _TRACKERS[name]


def names() -> list[str]:
  """The registered trackers' names, sorted."""
  return sorted(_TRACKERS)


def check_names(requested: Sequence[str]) -> None:
  """Raises ValueError naming the nearest registered name for each unknown one."""
  for name in requested:
    if name not in _TRACKERS:
      near = difflib.get_close_matches(name, names(), n=1)
      hint = f"did you mean {near[0]!r}? " if near else ""
      raise ValueError(f"unknown tracker {name!r} in TrainConfig.trackers; {hint}"
                       f"registered: {names()}")


def create(name: str, context: TrackerContext) -> Tracker:
  """A new tracker of the class registered as `name`."""
  check_names([name])
  return _TRACKERS[name](context)
