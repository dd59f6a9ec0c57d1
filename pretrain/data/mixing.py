"""Weighted mixtures of SeqIO tasks, named in Gin, with batches that are a pure function
of (seed, step, weights).

    web/corpus_task.files = '/data/fineweb/*.parquet'
    code/corpus_task.files = '/data/stack/*.jsonl.zst'
    code/corpus_task.text_field = 'content'
    DataPipeline.task = @mixture()
    mixture.tasks = {'web': @web/corpus_task(), 'code': @code/corpus_task()}
    mixture.weights = {'web': 0.8, 'code': 0.2}
    mixture.schedule = {1000: {'web': 0.5, 'code': 0.5}}   # optional: from step 1000

Each task keeps its own token store (the one it would have alone, so a prepared store
serves both). The rows of the global batch are dealt out over a fixed cycle of
`CYCLE` stream positions in which task k holds its share of positions, spread evenly
(the Sainte-Laguë order: every prefix of the cycle is within one row of proportional).
Position n of the stream therefore belongs to a task, and is that task's R_k(n)-th row,
both computed in closed form from the cycle (and the phase of the schedule n falls in);
task k's row stream is permuted per epoch exactly as a single task's (`indexing`). So the
batch at step s depends on (seed, s, weights, schedule) only: a resumed run, on any
number of processes, sees the same batches.

Weights are token shares: a task's row weight is divided by its store's mean tokens per
row (a padded row carries fewer tokens), so the realized token share follows the weight.
A phase change takes effect at the first step of its phase; weight 0 leaves a task out.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import gin
import numpy as np

from pretrain.data import indexing
from pretrain.data.errors import DataError

CYCLE = 1 << 14   # stream positions per cycle: weights are quantised to 1/CYCLE
RECORD_KIND = "mixture"

_REGISTRY: Dict[str, "MixtureSpec"] = {}


@dataclasses.dataclass(frozen=True)
class MixtureSpec:
  """Named tasks, weights at step 0, and later phases `((step, weights), ...)`."""
  name: str
  names: Tuple[str, ...]            # the mixture's own names for its tasks, in order
  tasks: Tuple[str, ...]            # registered SeqIO task names, same order
  phases: Tuple[Tuple[int, Tuple[float, ...]], ...]   # (first step, weights)


def _weights(names: Sequence[str], weights: Mapping[str, float], where: str
             ) -> Tuple[float, ...]:
  unknown = sorted(set(weights) - set(names))
  if unknown:
    raise DataError(f"{where} names {unknown[0]!r}, which is not in mixture.tasks "
                    f"({', '.join(names)}); give a weight to each task by its name")
  values = tuple(float(weights.get(n, 0.0)) for n in names)
  if any(not np.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
    raise DataError(f"{where}={dict(weights)} must be non-negative numbers, not all 0, "
                    "e.g. {'web': 0.7, 'code': 0.3}")
  return tuple(v / sum(values) for v in values)


@gin.configurable
def mixture(tasks: Mapping[str, str] = gin.REQUIRED,
            weights: Mapping[str, float] = gin.REQUIRED,
            schedule: Optional[Mapping[int, Mapping[str, float]]] = None,
            name: Optional[str] = None) -> str:
  """Registers a weighted mixture of tasks; returns its name (for `DataPipeline.task`).

  Args:
    tasks: {name: registered task}, e.g. {'web': @web/corpus_task()}.
    weights: {name: weight} from step 0: the share of tokens (normalised to sum 1;
      a task left out has weight 0).
    schedule: {step: weights} for later phases, e.g. an annealing mix.
    name: the mixture's name; by default derived from the other arguments.
  """
  if not tasks:
    raise DataError("mixture.tasks is empty; name the tasks to mix, e.g. "
                    "{'web': @web/corpus_task(), 'code': @code/corpus_task()}")
  names = tuple(tasks)
  phases = [(0, _weights(names, weights, "mixture.weights"))]
  for step, later in sorted((schedule or {}).items()):
    if int(step) <= 0:
      raise DataError(f"mixture.schedule step {step} must be > 0 (mixture.weights holds "
                      "step 0's weights)")
    phases.append((int(step), _weights(names, later, f"mixture.schedule[{step}]")))
  task_names = tuple(str(tasks[n]) for n in names)
  if name is None:
    key = json.dumps([names, task_names, phases])
    name = f"mixture_{hashlib.sha256(key.encode()).hexdigest()[:10]}"
  _REGISTRY[name] = MixtureSpec(name, names, task_names, tuple(phases))
  return name


def lookup(name: str) -> Optional[MixtureSpec]:
  """The mixture registered as `name`, or None (then it names a SeqIO task)."""
  return _REGISTRY.get(name)


def _cycle(row_weights: Sequence[float]) -> Tuple[np.ndarray, np.ndarray]:
  """(owner[CYCLE]: the task of each position of the cycle, before[CYCLE + 1, K]: how
  many positions each task holds before each position)."""
  w = np.asarray(row_weights, np.float64)
  w = w / w.sum()
  counts = np.floor(w * CYCLE).astype(np.int64)
  remainders = w * CYCLE - counts
  for k in np.argsort(-remainders, kind="stable")[:CYCLE - counts.sum()]:
    counts[k] += 1
  times = np.concatenate([(np.arange(c) + 0.5) / c for c in counts if c])
  owners = np.concatenate([np.full(c, k) for k, c in enumerate(counts) if c])
  owner = owners[np.lexsort((owners, times))]
  before = np.zeros((CYCLE + 1, len(w)), np.int64)
  before[1:] = np.cumsum(np.eye(len(w), dtype=np.int64)[owner], axis=0)
  return owner, before


class Mixer:
  """Which task and which of its rows each stream position of a mixture gets."""

  def __init__(self, spec: MixtureSpec, batch_size: int,
               tokens_per_row: Sequence[float]):
    self.spec = spec
    self.batch_size = batch_size
    fill = np.maximum(np.asarray(tokens_per_row, np.float64), 1e-9)
    self._phases: List[Tuple[int, np.ndarray, np.ndarray]] = []
    for step, weights in spec.phases:
      row_weights = np.asarray(weights) / fill
      owner, before = _cycle(row_weights)
      self._phases.append((step * batch_size, owner, before))

  def weights_at(self, step: int) -> Tuple[float, ...]:
    return [w for first, w in self.spec.phases if first <= step][-1]

  def _count_before(self, phase: int, position: int) -> np.ndarray:
    """Rows of each task among positions [phase start, position) of `phase`."""
    start, _, before = self._phases[phase]
    cycles, offset = divmod(position - start, CYCLE)
    return cycles * before[CYCLE] + before[offset]

  def assign(self, positions: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(task index, index in that task's row stream) of each stream position."""
    positions = np.asarray(positions, np.int64)
    starts = np.array([start for start, _, _ in self._phases])
    task = np.empty(positions.shape, np.int64)
    index = np.empty(positions.shape, np.int64)
    for p in np.unique(np.searchsorted(starts, positions, side="right") - 1):
      selected = (np.searchsorted(starts, positions, side="right") - 1) == p
      done = np.zeros(len(self.spec.tasks), np.int64)   # rows of earlier phases
      for q in range(p):
        done += self._count_before(q, self._phases[q + 1][0])
      start, owner, before = self._phases[p]
      rel = positions[selected] - start
      cycles, offset = np.divmod(rel, CYCLE)
      owners = owner[offset]
      task[selected] = owners
      index[selected] = (done[owners] + cycles * before[CYCLE][owners]
                         + before[offset, owners])
    return task, index


def task_seed(seed: int, task: int) -> int:
  """The row-order seed of the mixture's task `task`."""
  return int(np.random.SeedSequence([seed % 2**32, task, 0x6D6978]).generate_state(
      1, np.uint64)[0])


def stream_rows(index: np.ndarray, num_rows: int, seed: int) -> np.ndarray:
  """Store rows of positions `index` of a task's endless, per-epoch permuted stream."""
  epochs, offsets = np.divmod(np.asarray(index, np.int64), num_rows)
  rows = np.empty(len(offsets), np.int64)
  for epoch in np.unique(epochs):
    selected = epochs == epoch
    rows[selected] = indexing.permute(offsets[selected], num_rows, seed, int(epoch))
  return rows
