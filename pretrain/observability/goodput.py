"""Goodput: where a run's wall time went, per session and across restarts.

A session (one start of the trainer) splits its wall time into categories timed by the
loop (`GoodputClock.timed`):
  startup     building the data pipeline and the step programs, a fresh initialisation
  restore     reading the checkpoint it resumes from
  compile     the first train step (tracing and XLA compilation)
  data        waiting for the input pipeline
  checkpoint  the part of a save the loop blocks on (the device-to-host copy; the write
              itself is asynchronous)
  eval        validation and sampling
  other       every other hook (preemption sync, profiling)
  productive  the rest: training steps
Rows `{"kind": "goodput", ...}` of `metrics.jsonl` hold a session's running totals (every
`log_every` steps and at the end). When a session resumes, two more amounts are charged
to it:
  lost        steps run after the restored checkpoint by the previous session, which
              will be computed again; their time (the median logged `step_time_s`
              times their number) was counted as productive there and moves here
  downtime    from the previous session's last row to this session's start: the end of
              the crashed session, the restart and the imports
and a `{"kind": "restart", ...}` row records which steps are redone. The run's totals
(`run_totals`) add the sessions' last rows, so they sum to the run's wall time from the
first start to the last row.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Iterator, Mapping, Optional, Sequence

from pretrain.observability.metrics import format_duration

TIMED = ("startup", "restore", "compile", "data", "checkpoint", "eval", "other")
# The run-level breakdown, in the order reports show it; these sum to `wall_s`.
BREAKDOWN = ("productive", "lost", "downtime") + TIMED
GOODPUT, RESTART = "goodput", "restart"


class GoodputClock:
  """Times one session's categories; the untimed rest of the wall time is productive."""

  def __init__(self, session: int = 1):
    self.session = session
    self._started = time.perf_counter()
    self.start_time = time.time()
    self.seconds = dict.fromkeys(TIMED, 0.0)
    self.lost_s = self.downtime_s = 0.0
    self.lost_steps = 0

  @contextlib.contextmanager
  def timed(self, category: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
      yield
    finally:
      self.seconds[category] += time.perf_counter() - started

  def row(self, step: int) -> dict[str, Any]:
    """The session's running totals at `step`, as a `metrics.jsonl` row."""
    wall = time.perf_counter() - self._started
    row = {"kind": GOODPUT, "step": int(step), "session": self.session,
           "time": time.time(), "wall_s": wall,
           "productive_s": max(0.0, wall - sum(self.seconds.values()))}
    row.update({f"{name}_s": value for name, value in self.seconds.items()})
    row.update(lost_s=self.lost_s, lost_steps=self.lost_steps, downtime_s=self.downtime_s)
    return row

  def resume(self, restored_step: int, tier: Optional[str],
             earlier: Sequence[Mapping[str, Any]],
             dropped: Sequence[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """Charges the steps to be redone and the downtime to this session.

    `earlier` are the rows the file keeps, `dropped` the rows a rewind to
    `restored_step` removed (steps the previous session ran past its checkpoint).
    Returns the `restart` row to log, or None for the first session of a run.
    """
    sessions = [row for row in earlier if row.get("kind") == GOODPUT]
    if not sessions:
      return None
    # A session killed before its first goodput row left only its restart row; its time
    # is part of the downtime measured from the newest goodput row.
    self.session = max(row["session"] for row in earlier
                       if row.get("kind") in (GOODPUT, RESTART)) + 1
    self.downtime_s = max(0.0, self.start_time - max(row["time"] for row in sessions))
    steps = [row for row in dropped if "loss" in row and "kind" not in row]
    if steps:
      self.lost_steps = max(row["step"] for row in steps) - restored_step
      # The median over every step row of the run, not only the dropped ones: a session's
      # first logged step time includes its compilation, and when that row is the only
      # one dropped it alone would price the lost steps at a compile each.
      timed = [row["step_time_s"] for row in list(earlier) + list(dropped)
               if "loss" in row and "kind" not in row and "step_time_s" in row]
      self.lost_s = self.lost_steps * statistics.median(timed)
    return {"kind": RESTART, "step": int(restored_step), "session": self.session,
            "tier": tier, "redone_from": restored_step + 1,
            "redone_to": restored_step + self.lost_steps, "lost_steps": self.lost_steps,
            "lost_s": self.lost_s, "downtime_s": self.downtime_s, "time": self.start_time}


def last_rows_per_session(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
  """The newest goodput row of each session, in session order."""
  newest: dict[int, Mapping[str, Any]] = {}
  for row in rows:
    if row.get("kind") == GOODPUT:
      newest[row["session"]] = row
  return [newest[session] for session in sorted(newest)]


def run_totals(rows: Sequence[Mapping[str, Any]]) -> Optional[dict[str, float]]:
  """Seconds per category of the whole run (`BREAKDOWN`, plus `wall`, `goodput` as a
  fraction and `sessions`), from its goodput rows; None when there are none."""
  sessions = last_rows_per_session(rows)
  if not sessions:
    return None
  totals = {name: sum(row[f"{name}_s"] for row in sessions) for name in TIMED}
  totals["lost"] = sum(row["lost_s"] for row in sessions)
  totals["downtime"] = sum(row["downtime_s"] for row in sessions)
  totals["productive"] = sum(row["productive_s"] for row in sessions) - totals["lost"]
  totals["wall"] = sum(row["wall_s"] + row["downtime_s"] for row in sessions)
  totals["goodput"] = totals["productive"] / totals["wall"] if totals["wall"] > 0 else 0.0
  totals["sessions"] = len({row["session"] for row in rows
                            if row.get("kind") in (GOODPUT, RESTART)})
  totals["lost_steps"] = sum(row["lost_steps"] for row in sessions)
  return totals


def format_totals(totals: Mapping[str, float]) -> str:
  """'goodput 81.3% of 5m10s over 3 sessions: productive 4m12s, compile 21s, ...'."""
  parts = ", ".join(f"{name} {format_duration(totals[name])}" for name in BREAKDOWN
                    if totals[name] >= 0.5 or name == "productive")
  sessions = int(totals["sessions"])
  return (f"goodput {100 * totals['goodput']:.1f}% of {format_duration(totals['wall'])}"
          f" over {sessions} session{'s' if sessions != 1 else ''}: {parts}")
