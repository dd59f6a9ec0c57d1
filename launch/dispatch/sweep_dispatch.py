"""Where a study's runs execute: the backends, registered by name, and the run states
every backend reads from the runs' directories.

A backend (`Backend`) is one module that owns its `launch.sweep` flags, how it turns
the study's jobs into its own specs, and how it starts them: this machine, N at a time
(`launch.sweeps.sweep_local`), one SLURM job array (`launch.slurm`), one GKE JobSet per run
(`launch.gke`), one TPU queued resource per run (`launch.tpu_vm`). Each is registered
here (`register`; `launch.sweeps.sweep_execute` lists the built-ins) and `--backend=NAME` is
looked up by name (`get`), so a new backend is one module and no switch changes. This
module imports no backend, so every backend may import it.

A run's state is read from its directory, never from the dispatcher's memory, so that a
study can be stopped and resumed, or submitted twice, without redoing work:
  finished     its metrics hold the final evaluation (launch.sweeps.sweep_results.final_eval);
  running      `sweep_status.json` (launch.sweep_job) says running, or submitted to a
               cluster; on this host a running status whose process is gone counts as
               interrupted instead, and on a cluster whose backend can ask the
               scheduler (SLURM) one whose job has ended counts as failed;
  interrupted  stopped from outside (SIGTERM/SIGKILL, a preemption): resumed, free;
  failed       exited with an error `failures` times: retried while failures <=
               --max_retries;
  pending      never started.
"""
from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

from absl import flags

from launch.dispatch import scheduler
from launch.dispatch import sweep_job
from plumbing.errors import UserError, usage_error

FINISHED, RUNNING, INTERRUPTED, FAILED, PENDING = (
    "finished", "running", "interrupted", "failed", "pending")


@dataclasses.dataclass(frozen=True)
class Job:
  """One run to start: its name, directory and training command; `work` (its training
  FLOPs) weighs it in the local backend's ETA (launch.sweeps.sweep_progress); `after` names
  the job it starts from (a cooldown fork's stable run), if any."""
  name: str
  run_dir: str
  command: List[str]
  work: float = 1.0
  after: Optional[str] = None

  def wrapped(self, python: str = "python") -> List[str]:
    """The command inside launch.sweep_job, which records how it ends."""
    return [python, "-m", "launch.sweep_job", f"--run_dir={self.run_dir}", "--",
            *self.command]


def _process_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def run_state(run_dir: str, finished: bool) -> tuple[str, int]:
  """(state, failures so far) of the run in `run_dir` (module docstring)."""
  status = sweep_job.read_status(run_dir) or {}
  failures = int(status.get("failures", 0))
  if finished:
    return FINISHED, failures
  state = status.get("state")
  if state is None:
    return PENDING, failures
  if state == "running" and status.get("host") == socket.gethostname():
    if not _process_alive(int(status.get("pid", -1))):
      return INTERRUPTED, failures
    return RUNNING, failures
  if state in ("submitted", "running"):
    if _record_lost_job(run_dir, status):
      return FAILED, failures + 1
    return RUNNING, failures
  if status.get("exit_code") in sweep_job.INTERRUPTED_CODES:
    return INTERRUPTED, failures
  return FAILED, failures


def _record_lost_job(run_dir: str, status: dict) -> bool:
  """Whether the cluster job of a run that is `submitted` (or `running` on another
  host) has ended without launch.sweep_job recording how: cancelled while queued, its
  node lost, or a `--setup` that failed before the run started. Then the run is
  recorded as failed (so `--max_retries` bounds the resubmissions), with the reason,
  while the scheduler still remembers the job. A backend that cannot tell
  (no `job_alive`) leaves the run `running`."""
  backend = _BACKENDS.get(status.get("backend", ""))
  job_alive = getattr(backend, "job_alive", None)
  job_id = status.get("job_id")
  if job_alive is None or job_id is None or job_alive(job_id) is not False:
    return False
  if sweep_job.read_status(run_dir) != status:   # it recorded its end meanwhile
    return False
  sweep_job.write_status(run_dir, {
      "state": "exited", "exit_code": None, "failures": int(status.get("failures", 0)) + 1,
      "why": f"{backend.name} job {job_id} ended without recording how it ended "
             "(cancelled, a lost node, or a --setup that failed; see its log)"})
  return True


def running_here(run_dir: str) -> bool:
  """Whether the run is a live process on this host (e.g. left by a killed sweep)."""
  status = sweep_job.read_status(run_dir) or {}
  return (status.get("state") == "running" and status.get("host") == socket.gethostname()
          and _process_alive(int(status.get("pid", -1))))


@dataclasses.dataclass(frozen=True)
class Study:
  """What a backend is told besides its jobs.

  Attributes:
    directory: the study's directory (cluster logs go to its `logs/`).
    max_retries: how often a failed run is started again.
    dry_run: print the jobs' specs instead of starting anything.
    log: where progress lines go.
    ready: whether a job may start now (a cooldown fork: once its stable run has
      finished); a job that is not ready waits, here or for a later run of the command.
    is_finished: whether a job's run holds its final evaluation.
    finished, running, failed: the study's runs that finished, run elsewhere and were
      given up before these jobs (the local backend's progress line counts them).
  """
  directory: str
  max_retries: int
  dry_run: bool
  log: Callable[[str], None]
  ready: Callable[[Job], bool]
  is_finished: Callable[[Job], bool]
  finished: int = 0
  running: int = 0
  failed: int = 0


class Backend(Protocol):
  """One place a study's runs execute, chosen by `--backend=name`.

  Attributes:
    name: the `--backend` value.
    here: whether the runs execute on this machine: their commands name this
      interpreter (a cluster's name the nodes' `python`, after `--setup`), a dry run
      also prints each run's bindings, and runs left training by an earlier, killed
      sweep are waited for.
  """
  name: str
  here: bool

  def define_flags(self) -> None:
    """Defines the backend's `launch.sweep` flags (absl), when the sweep runs as a
    program; a flag several backends read is defined through `define_once`."""

  def from_flags(self, values: flags.FlagValues) -> Backend:
    """This backend with the options the parsed flags give it.

    Raises:
      UserError (exit code 2): a flag it cannot run without is missing or bad.
    """

  def dispatch(self, jobs: Sequence[Job], study: Study) -> List[str]:
    """Starts `jobs` (or, on a dry run, prints what it would start); returns the names
    of the jobs given up. A backend that only submits returns at once: each run then
    records its own state (launch.sweep_job), which the next run of the command reads."""


_BACKENDS: Dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
  """Adds `backend` under `backend.name` (in registration order, `--backend`'s order);
  returns it.

  Raises:
    ValueError: the name is taken by a different backend.
  """
  taken = _BACKENDS.get(backend.name)
  if taken is not None and taken != backend:
    raise ValueError(f"backend {backend.name!r} is registered already ({taken!r})")
  _BACKENDS[backend.name] = backend
  return backend


def unregister(name: str) -> None:
  """Removes a backend (for tests that register one of their own)."""
  del _BACKENDS[name]


def names() -> List[str]:
  """The registered backends' names, in registration order."""
  return list(_BACKENDS)


def get(name: str) -> Backend:
  """The backend registered as `name`.

  Raises:
    ValueError: nothing is registered as `name` (the message lists what is).
  """
  backend = _BACKENDS.get(name)
  if backend is None:
    raise ValueError(f"unknown backend {name!r}; expected one of {names()}")
  return backend


def define_once(define: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> None:
  """`define(name, *args, **kwargs)` (an absl DEFINE_*) unless a backend defined `name`
  already: for the flags several backends read (`--job_name`, `--tpu_type`)."""
  if name not in flags.FLAGS:
    define(name, *args, **kwargs)


def require_flags(values: flags.FlagValues, backend: str, names_: Sequence[str]) -> None:
  """A usage error naming the flags of `names_` that `--backend=backend` lacks."""
  missing = [f"--{name}" for name in names_ if not getattr(values, name)]
  if missing:
    raise usage_error(f"--backend={backend} needs {' and '.join(missing)}")


def dns_name(*parts: str, suffix: str = "") -> str:
  """A Kubernetes/GCE resource name: lower-case letters, digits and '-', <= 63 chars;
  `suffix` (an attempt number) is kept whole, so resubmissions never collide."""
  name = re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
  tail = f"-{suffix}" if suffix else ""
  return name[:63 - len(tail)].rstrip("-") + tail


@dataclasses.dataclass(frozen=True)
class Submission:
  """One command that submits jobs to a cluster (its `stdin`, if any, is the spec), the
  spec a dry run prints for it, the local directories the jobs write into that must
  exist before they start (a scheduler does not create its output's directory), and,
  for a backend with `job_alive`, how to read each run's job id (by run directory)
  from what the command printed."""
  argv: List[str]
  stdin: Optional[str]
  spec: str
  directories: tuple[str, ...] = ()
  job_ids: Optional[Callable[[str], Dict[str, str]]] = None


def submit_when_ready(backend: str, jobs: Sequence[Job], study: Study,
                      submissions: Callable[[Sequence[Job], int, str], List[Submission]]
                      ) -> List[str]:
  """A cluster backend's `dispatch`: submits the jobs that are ready, each marked
  `submitted`; a fork whose stable run has not finished is submitted by a later run of
  the command (a dry run prints its spec after the others'). `submissions(jobs,
  attempt, study_dir)` builds the backend's specs; `attempt` (a time stamp) keeps
  resubmitted names apart. Nothing is given up here: the next run of the command reads
  how each run ended."""
  later = [job for job in jobs if not study.ready(job)]
  _submit(backend, [job for job in jobs if study.ready(job)], study, submissions)
  if later and study.dry_run:
    print("# Submitted by a later run of this command, once each fork's stable run has "
          "finished (launch.fork copies its checkpoint first):")
    _submit(backend, later, study, submissions)
  elif later:
    study.log(f"[sweep] {len(later)} fork(s) wait for their stable runs; run the same "
              "command again once those have finished")
  return []


def _submit(backend: str, jobs: Sequence[Job], study: Study,
            submissions: Callable[[Sequence[Job], int, str], List[Submission]]) -> None:
  """Prints (dry run) or submits the cluster jobs, marking each run `submitted`."""
  if not jobs:
    return
  batch = submissions(jobs, int(time.time()), study.directory)
  if study.dry_run:
    sys.stdout.write("".join(submission.spec for submission in batch))
    return
  job_ids: Dict[str, str] = {}
  for submission in batch:
    for directory in submission.directories:
      os.makedirs(directory, exist_ok=True)
    result = scheduler.run(submission.argv, stdin=submission.stdin,
                           stdout=bool(submission.job_ids))
    if result.returncode != 0:
      raise UserError(f"{submission.argv[0]} exited with code {result.returncode} (its "
                      "message is above)")
    if submission.job_ids:
      job_ids.update(submission.job_ids(result.stdout))
  for job in jobs:
    status = {"state": "submitted", "backend": backend,
              "failures": run_state(job.run_dir, False)[1]}
    if job.run_dir in job_ids:
      status["job_id"] = job_ids[job.run_dir]
    sweep_job.write_status(job.run_dir, status)
  study.log(f"[sweep] submitted {len(jobs)} run(s) to {backend}; run the same command "
            "again to see progress, resubmit failures and collect the results")
