"""What a local study is doing while its runs train: one line on stderr per change.

  [sweep] progress: 4/15 finished, 1 running, 9 pending, 1 failed; elapsed 6m02s; ETA 18m40s

`launch.sweeps.sweep_local.run_local` tells a `Progress` when each run starts and ends and
calls `tick()` as it polls; a line is written whenever the counts change, and otherwise
at most every `interval_s` seconds (the ETA moves as running runs age).

The ETA comes from the runs finished during this sweep. A run's duration is modelled as
a fixed cost plus a cost per unit of work (its training FLOPs: `launch.sweep` passes
them): seconds = a + b·work, fitted by least squares once the finished runs' work
spans a factor `AFFINE_SPAN` (runs of one isoFLOP budget have nearly equal work, which
says nothing about the slope) and both coefficients come out non-negative, else
seconds = b·work with b the finished runs' total seconds over their total work. The fixed part matters on small
studies, where start-up and compilation (tens of seconds) rival the training itself. A
pending run is predicted whole, a running one less the time it has already run (at
least zero); the ETA is the larger of their sum divided by `parallel` and the longest
single prediction. Before any run has finished it is unknown.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, TextIO, Tuple

from pretrain.observability.metrics import format_duration

AFFINE_SPAN = 1.5


def duration_model(finished: Sequence[Tuple[float, float]]) -> Optional[Tuple[float, float]]:
  """(a, b) of seconds = a + b·work from (work, seconds) pairs; None when empty."""
  if not finished:
    return None
  works = [w for w, _ in finished]
  seconds = [s for _, s in finished]
  if min(works) > 0 and max(works) >= AFFINE_SPAN * min(works):
    n = len(works)
    mean_w, mean_s = sum(works) / n, sum(seconds) / n
    var_w = sum((w - mean_w) ** 2 for w in works)
    b = sum((w - mean_w) * (s - mean_s) for w, s in finished) / var_w
    a = mean_s - b * mean_w
    if a >= 0 and b >= 0:
      return a, b
  total_work = sum(works)
  if total_work <= 0:                     # no work given: every run costs the mean
    return sum(seconds) / len(seconds), 0.0
  return 0.0, sum(seconds) / total_work


class Progress:
  """Counts of a local study's runs and the ETA, written as one line per change.

  Args:
    work: each job's work (e.g. training FLOPs) by name; the jobs this sweep may start.
    parallel: runs at a time.
    finished, running, failed: runs counted as such before this sweep started anything
      (finished earlier, training elsewhere, failed beyond the retries).
    interval_s: the longest silence while nothing changes.
    clock, stream: for tests; time.monotonic and stderr by default.
  """

  def __init__(self, work: Dict[str, float], parallel: int, *, finished: int = 0,
               running: int = 0, failed: int = 0, interval_s: float = 10.0,
               clock: Callable[[], float] = time.monotonic,
               stream: Optional[TextIO] = None):
    self._work = dict(work)
    self._parallel = max(1, parallel)
    self._before = {"finished": finished, "running": running, "failed": failed}
    self._interval_s = interval_s
    self._clock = clock
    self._stream = stream
    self._start = clock()
    self._pending = set(work)
    self._started_at: Dict[str, float] = {}
    self._done: List[Tuple[float, float]] = []    # (work, seconds) of finished runs
    self._failed: List[str] = []
    self._last_counts: Optional[Tuple[int, ...]] = None
    self._last_time = -float("inf")

  def started(self, name: str) -> None:
    self._pending.discard(name)
    self._started_at[name] = self._clock()

  def ended(self, name: str, outcome: str) -> None:
    """`outcome`: 'finished', 'failed' (given up) or 'retry' (pending again)."""
    began = self._started_at.pop(name)
    if outcome == "finished":
      self._done.append((self._work[name], self._clock() - began))
    elif outcome == "failed":
      self._failed.append(name)
    elif outcome == "retry":
      self._pending.add(name)
    else:
      raise ValueError(f"unknown outcome {outcome!r}")

  def counts(self) -> Tuple[int, int, int, int]:
    """(finished, running, pending, failed)."""
    return (self._before["finished"] + len(self._done),
            self._before["running"] + len(self._started_at), len(self._pending),
            self._before["failed"] + len(self._failed))

  def eta_s(self) -> Optional[float]:
    """Seconds until every started or pending run is done; None before any finished."""
    if not self._pending and not self._started_at:
      return 0.0
    model = duration_model(self._done)
    if model is None:
      return None
    a, b = model
    now = self._clock()
    left = [a + b * self._work[name] for name in self._pending]
    left += [max(0.0, a + b * self._work[name] - (now - began))
             for name, began in self._started_at.items()]
    return max(sum(left) / self._parallel, max(left))

  def line(self) -> str:
    finished, running, pending, failed = self.counts()
    total = finished + running + pending + failed
    eta = self.eta_s()
    eta_text = "unknown until a run finishes" if eta is None else format_duration(eta)
    return (f"[sweep] progress: {finished}/{total} finished, {running} running, "
            f"{pending} pending, {failed} failed; elapsed "
            f"{format_duration(self._clock() - self._start)}; ETA {eta_text}")

  def tick(self) -> bool:
    """Writes the line if the counts changed or `interval_s` has passed; whether it did."""
    counts = self.counts()
    now = self._clock()
    if counts == self._last_counts and now - self._last_time < self._interval_s:
      return False
    self._last_counts, self._last_time = counts, now
    stream = self._stream or sys.stderr
    stream.write(self.line() + "\n")
    stream.flush()
    return True
