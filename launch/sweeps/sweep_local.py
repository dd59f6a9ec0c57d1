"""The local backend of `launch.sweep`: a study's runs on this machine, N at a time.

`--backend=local` (the default). Each run is a child process of the sweep, wrapped in
`launch.sweep_job`; failures are retried up to `--max_retries`, a cooldown fork starts
as soon as its stable run has finished, and a progress line with an ETA goes to stderr
(`launch.sweeps.sweep_progress`). Its one flag is `--parallel`.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from absl import flags

from launch.dispatch import sweep_dispatch
from launch.sweeps import sweep_progress

_POLL_S = 0.2


def default_parallel() -> int:
  """Local runs at a time: one per 4 cores (each JAX process runs several threads)."""
  return max(1, (os.cpu_count() or 1) // 4)


def run_local(jobs: Sequence[sweep_dispatch.Job], parallel: int, max_retries: int,
              is_finished: Callable[[sweep_dispatch.Job], bool],
              log: Callable[[str], None] = print,
              progress: Optional[sweep_progress.Progress] = None,
              ready: Callable[[sweep_dispatch.Job], bool] = lambda job: True) -> List[str]:
  """Runs `jobs` on this machine, at most `parallel` at once, retrying failures.

  Each job's output goes to `sweep_train.log` in its directory. SIGINT/SIGTERM are passed
  on to the running trainings (which checkpoint) before the sweep exits. `progress`
  (created here if None) writes the counts and ETA to stderr as runs start and end.
  A job starts only once `ready` says so (a cooldown fork: once its stable run has
  finished); jobs that can never become ready (what they wait for gave up) are given
  up too. Returns the names of the jobs that failed more than `max_retries` times, or
  were never ready.
  """
  if progress is None:
    progress = sweep_progress.Progress({job.name: job.work for job in jobs}, parallel)
  queue, running, given_up = list(jobs), {}, []
  unfinished_exits: Dict[str, int] = {}
  unrecorded_exits: Dict[str, int] = {}

  def stop(signum, _frame):
    for _, process in running.values():
      if process.poll() is None:
        os.killpg(process.pid, signum)
    for _, process in running.values():
      process.wait()
    raise SystemExit(128 + signum)
  previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    while queue or running:
      while len(running) < parallel:
        job = next((j for j in queue if ready(j)), None)
        if job is None:
          break
        queue.remove(job)
        os.makedirs(job.run_dir, exist_ok=True)
        log(f"[sweep] start {job.name}")
        with open(os.path.join(job.run_dir, "sweep_train.log"), "a",
                  encoding="utf-8") as out:
          running[job.name] = job, subprocess.Popen(job.wrapped(sys.executable), stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        progress.started(job.name)
      progress.tick()
      time.sleep(_POLL_S)
      for name, (job, process) in list(running.items()):
        if process.poll() is None:
          continue
        del running[name]
        state, failures = sweep_dispatch.run_state(job.run_dir, is_finished(job))
        if state == sweep_dispatch.FINISHED:
          log(f"[sweep] {job.name}: finished")
          progress.ended(job.name, "finished")
        elif (state == sweep_dispatch.PENDING
              and unrecorded_exits.get(job.name, 0) >= max_retries):
          # Its launch.sweep_job ended without recording the run (no status: the run
          # directory could not be written, or the environment named it a process other
          # than 0): bounded like failures rather than started again forever.
          log(f"[sweep] {job.name}: exited {process.returncode} {max_retries + 1} times "
              "without recording its status; see "
              f"{os.path.join(job.run_dir, 'sweep_train.log')}")
          given_up.append(job.name)
          progress.ended(job.name, "failed")
        elif state == sweep_dispatch.FAILED and failures > max_retries:
          log(f"[sweep] {job.name}: failed {failures} times, giving up; see "
              f"{os.path.join(job.run_dir, 'sweep_train.log')}")
          given_up.append(job.name)
          progress.ended(job.name, "failed")
        elif state == sweep_dispatch.INTERRUPTED and unfinished_exits.get(job.name, 0) >= max_retries:
          # Nobody stopped it, yet it ended without its final evaluation.
          log(f"[sweep] {job.name}: exited {process.returncode} without the final evaluation "
              "at its last step; does the data config have a validation split? See "
              f"{os.path.join(job.run_dir, 'sweep_train.log')}")
          given_up.append(job.name)
          progress.ended(job.name, "failed")
        else:
          if state == sweep_dispatch.INTERRUPTED:
            unfinished_exits[job.name] = unfinished_exits.get(job.name, 0) + 1
          if state == sweep_dispatch.PENDING:
            unrecorded_exits[job.name] = unrecorded_exits.get(job.name, 0) + 1
          log(f"[sweep] {job.name}: {state} (exit code {process.returncode}, "
              f"{failures} failures), starting again")
          queue.append(job)
          progress.ended(job.name, "retry")
      if queue and not running and not any(ready(j) for j in queue):
        for job in queue:
          log(f"[sweep] {job.name}: what it starts from never finished; not started")
          given_up.append(job.name)
          progress.started(job.name)   # counted as failed, like a run given up
          progress.ended(job.name, "failed")
        queue.clear()
    progress.tick()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  return given_up


@dataclasses.dataclass(frozen=True)
class LocalBackend:
  """`--backend=local`: `parallel` runs at a time on this machine (sweep_dispatch.Backend)."""
  parallel: int = dataclasses.field(default_factory=default_parallel)

  name = "local"
  here = True

  def define_flags(self) -> None:
    flags.DEFINE_integer("parallel", self.parallel,
                         "Local backend: runs at a time (default: one per 4 cores).",
                         lower_bound=1)

  def from_flags(self, values: flags.FlagValues) -> LocalBackend:
    return dataclasses.replace(self, parallel=values.parallel)

  def dispatch(self, jobs: Sequence[sweep_dispatch.Job],
               study: sweep_dispatch.Study) -> List[str]:
    """Runs `jobs` until each finished or was given up (`run_local`); a dry run prints
    their commands, a fork's after a line naming its stable run."""
    if study.dry_run:
      for job in jobs:
        if not study.ready(job):
          print(f"# once {job.after} has finished:")
        print(shlex.join(job.wrapped(sys.executable)))
      return []
    progress = sweep_progress.Progress(
        {job.name: job.work for job in jobs}, self.parallel, finished=study.finished,
        running=study.running, failed=study.failed)
    return run_local(jobs, self.parallel, study.max_retries, study.is_finished,
                     study.log, progress, study.ready)
