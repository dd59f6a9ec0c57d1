"""Runs one training run of a study and records how it ended in the run's directory.

The library of `python -m launch.sweep_job` (launch/sweep_job.py, whose docstring is the
command's manual; its flags and main are there).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from typing import Optional, Sequence


from plumbing import storage

STATUS_FILE = "sweep_status.json"
_PROCESS_INDEX_VARIABLES = ("SLURM_PROCID", "TPU_WORKER_ID", "JOB_COMPLETION_INDEX")
# Exit codes of a run stopped from outside (the trainer checkpoints on SIGTERM and exits
# 0); such a run is resumed, not counted as a failure.
INTERRUPTED_CODES = frozenset({0, -signal.SIGTERM, -signal.SIGINT, -signal.SIGKILL,
                               128 + signal.SIGTERM, 128 + signal.SIGINT,
                               128 + signal.SIGKILL})


def read_status(run_dir: str) -> Optional[dict]:
  path = storage.join(run_dir, STATUS_FILE)
  try:
    return json.loads(storage.read_text(path)) if storage.exists(path) else None
  except (FileNotFoundError, json.JSONDecodeError):
    return None


def write_status(run_dir: str, status: dict) -> None:
  """Writes the status whole (a temporary file renamed over the old one locally, one
  upload on object storage)."""
  storage.write_text(storage.join(run_dir, STATUS_FILE),
                     json.dumps(dict(status, time=time.time())))


def is_process_zero() -> bool:
  return all(os.environ.get(name, "0") == "0" for name in _PROCESS_INDEX_VARIABLES)


def run(command: Sequence[str], run_dir: str) -> int:
  """Runs `command`, recording its start and exit in `run_dir`; returns its exit code."""
  writer = is_process_zero()
  submitted = read_status(run_dir) or {}
  failures = int(submitted.get("failures", 0))
  process = subprocess.Popen(list(command))
  if writer:
    # The cluster job stays named, so a sweep can ask the scheduler whether it lives.
    job = {key: submitted[key] for key in ("backend", "job_id") if key in submitted}
    write_status(run_dir, {"state": "running", "host": socket.gethostname(),
                           "pid": os.getpid(), "failures": failures, **job})

  def forward(signum, _frame):
    if process.poll() is None:
      process.send_signal(signum)
  previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    code = process.wait()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  if writer:
    if code not in INTERRUPTED_CODES:
      failures += 1
    write_status(run_dir, {"state": "exited", "exit_code": code, "failures": failures})
  return code
