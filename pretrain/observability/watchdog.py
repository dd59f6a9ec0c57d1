"""A per-process watchdog: a process that stops making progress exits, so the launcher
restarts the job from its newest checkpoint instead of waiting forever.

A process hangs rather than dies when a collective waits for a peer that never comes, a
file system stops answering (a dead NFS mount) or an input pipeline blocks. The launchers
notice a dead process (its exit, a missed heartbeat) but not a hung one. The training
loop runs each part of a step inside `Watchdog.phase(name)`; a daemon thread checks that
the current phase ends within its allowance. When one does not, the thread writes every
Python thread's stack (`faulthandler`) to a file, prints one line naming the phase, the
step and that file, and ends the process with exit code 1 (`os._exit`: the main thread
may be blocked inside a C call that never returns).

Allowances (`allowance`):
  * `timeout_s` when given; otherwise derived from the run itself: `factor` times the
    median step time of the recent steps, never below `floor_s` (a step of a large model
    can take minutes; the floor keeps a slow but healthy step from being called a hang);
  * `long_s` before the first step has completed (restore, tracing and compilation) and
    for the phases that legitimately take long (`LONG_PHASES`: evaluation, which
    compiles its own programs, and checkpoint waits).

Phases: startup (restore, first compilation), data (the input pipeline), step
(dispatching the step; with one process also waiting for its result), collective
(with several processes, waiting for the step's result, which needs every process's
part of its collectives), checkpoint, eval, other (the remaining hooks).

The watchdog also times each process's host work per step (data and dispatch, the
phases before a process joins the step's collectives): `host_seconds` feeds the
straggler rows (`pretrain.observability.stragglers`).
"""
from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from typing import Callable, Iterator, Optional

from plumbing.errors import EXIT_FAILED

PHASES = ("startup", "data", "step", "collective", "checkpoint", "eval", "other")
LONG_PHASES = frozenset({"startup", "checkpoint", "eval"})
HOST_PHASES = frozenset({"data", "step"})   # a process's own work in a step
FLOOR_S = 120.0       # a derived allowance is never shorter
FACTOR = 10.0         # times the median step time
LONG_S = 1800.0       # first step (restore, compilation), evaluation, checkpoint waits
RECENT_STEPS = 100    # step times the median is taken over
CHECK_EVERY_S = 0.5


class Watchdog:
  """Ends this process when a phase outlasts its allowance (see the module docstring).

  Args:
    timeout_s: the allowance of a phase once a step has completed; None derives it
      from the median step time (`factor` x, at least `floor_s`).
    long_s: the allowance before the first step completes and of `LONG_PHASES`.
    stacks_dir: where the stack dump of a hang is written (a local directory:
      `pretrain.run_directory.RunDirectory.hangs`).
    process_index: named in the line and the dump's file name.
    multi_process: whether waiting for a step's result is a wait on other processes
      (phase "collective" rather than "step").
    on_hang: what to do with the line once the stacks are written; by default print
      it and exit with code 1 (tests pass their own).
  """

  def __init__(self, timeout_s: Optional[float], *, long_s: float = LONG_S,
               stacks_dir: str, process_index: int = 0, multi_process: bool = False,
               floor_s: float = FLOOR_S, factor: float = FACTOR,
               on_hang: Optional[Callable[[str], None]] = None):
    self._timeout_s = timeout_s
    self._long_s = long_s
    self._floor_s = floor_s
    self._factor = factor
    self._stacks_dir = stacks_dir
    self._process_index = process_index
    self.wait_phase = "collective" if multi_process else "step"
    self._on_hang = on_hang or _exit_hung
    self._lock = threading.Lock()
    self._phase = "startup"
    self._phase_started = time.monotonic()
    self._step = 0
    self._steps_done = 0
    self._last_step_at: Optional[float] = None
    self._step_times: collections.deque = collections.deque(maxlen=RECENT_STEPS)
    self._host_s = 0.0
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  # -- the loop's side -------------------------------------------------------------
  def start(self) -> None:
    """Starts watching (phase "startup")."""
    with self._lock:
      self._phase, self._phase_started = "startup", time.monotonic()
    self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  @contextlib.contextmanager
  def phase(self, name: str) -> Iterator[None]:
    """Runs the block as phase `name`; the phase before resumes after it."""
    with self._lock:
      outer, self._phase = self._phase, name
      started = self._phase_started = time.monotonic()
    try:
      yield
    finally:
      with self._lock:
        now = time.monotonic()
        if name in HOST_PHASES:
          self._host_s += now - started
        self._phase, self._phase_started = outer, now

  def step_done(self, step: int) -> None:
    """Step `step` has completed (its results reached the host): its time counts
    towards the derived allowance. Calls for a step already counted are ignored."""
    now = time.monotonic()
    with self._lock:
      if step <= self._step:
        return
      if self._last_step_at is not None:
        self._step_times.append(now - self._last_step_at)
      self._last_step_at = now
      self._step = step
      self._steps_done += 1

  def paused(self) -> None:
    """The loop paused between steps (a hook ran): the next step's time starts now."""
    with self._lock:
      self._last_step_at = time.monotonic()

  def host_seconds(self) -> float:
    """This process's seconds in the data and step phases so far."""
    with self._lock:
      return self._host_s

  # -- the watching side -----------------------------------------------------------
  def allowance(self, phase: str) -> float:
    """Seconds phase `phase` may last now."""
    if phase in LONG_PHASES or not self._steps_done:
      return max(self._long_s, self._timeout_s or 0.0)
    if self._timeout_s is not None:
      return self._timeout_s
    median = statistics.median(self._step_times) if self._step_times else 0.0
    return max(self._floor_s, self._factor * median)

  def check(self, now: Optional[float] = None) -> Optional[str]:
    """The line describing a hang, when the current phase has outlasted its
    allowance; None otherwise."""
    now = time.monotonic() if now is None else now
    with self._lock:
      phase, elapsed, step = self._phase, now - self._phase_started, self._step
      limit = self.allowance(phase)
    if elapsed <= limit:
      return None
    return (f"process {self._process_index} hung: no progress for {elapsed:.0f} s "
            f"(allowed {limit:.0f} s) in phase {phase}; newest completed step {step}")

  def _watch(self) -> None:
    while not self._stop.wait(CHECK_EVERY_S):
      line = self.check()
      if line is not None:
        path = self._dump_stacks()
        self._on_hang(f"{line}; Python stacks in {path}; exiting so that the launcher "
                      "restarts the run")
        return

  def _dump_stacks(self) -> str:
    """Writes every thread's Python stack to a new file; returns its path."""
    os.makedirs(self._stacks_dir, exist_ok=True)
    path = os.path.join(self._stacks_dir, f"process_{self._process_index}-"
                        f"{time.strftime('%Y%m%d-%H%M%S')}.txt")
    with open(path, "w", encoding="utf-8") as f:
      faulthandler.dump_traceback(f, all_threads=True)
    return path


def _exit_hung(line: str) -> None:
  print(f"error: {line}", file=sys.stderr, flush=True)
  os._exit(EXIT_FAILED)  # pylint: disable=protected-access  # the main thread is stuck
