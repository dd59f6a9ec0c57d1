"""The scheduler's commands (`sbatch`, `squeue`, `kubectl`, `gcloud`), each with a bound.

A scheduler that does not answer (slurmctld stopped or swamped, a Kubernetes API server
or Google Cloud behind a network that drops packets) makes its client wait: `sbatch` and
`squeue` retry for minutes, `kubectl` and `gcloud` set no deadline of their own. A
launcher that waited with them would hold the terminal, or a sweep's status check,
without a word. `run` gives every command `timeout_s()` seconds, then stops it (its
whole process group: the clients may run helpers) and ends the launcher with one line
naming the command, the scheduler to check and the setting that allows longer.

Not for commands that run the training itself (`launch.tpu_vm`'s `gcloud ... ssh`):
those last as long as the run.
"""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Optional, Sequence

from plumbing import environment
from plumbing.errors import UserError

# Seconds a scheduler command may take before the launcher gives up on it; a busy
# scheduler answers in seconds, so this only ever ends a scheduler that is not there.
DEFAULT_TIMEOUT_S = 120.0
TIMEOUT_ENV = "GRIFFIN_SCHEDULER_TIMEOUT_S"
# What to check when a command does not answer, by command.
_CHECKS = {"sbatch": "slurmctld (scontrol ping)", "squeue": "slurmctld (scontrol ping)",
           "kubectl": "the cluster's API server (kubectl cluster-info)",
           "gcloud": "the Cloud TPU API (gcloud compute tpus queued-resources list)"}


def timeout_s() -> float:
  """The bound: `GRIFFIN_SCHEDULER_TIMEOUT_S` when set, else `DEFAULT_TIMEOUT_S`."""
  return environment.positive_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S,
                                      "a scheduler command may take")


def run(argv: Sequence[str], stdin: Optional[str] = None, stdout: bool = False,
        stderr: bool = False) -> subprocess.CompletedProcess:
  """Runs scheduler command `argv` (text in and out; its `stdout` or `stderr` captured
  when asked, else the launcher's) and returns how it ended, whatever its exit code. A
  command that is not installed, or that has not ended after `timeout_s()`, is a
  `UserError`."""
  limit = timeout_s()
  try:
    process = subprocess.Popen(
        list(argv), stdin=subprocess.PIPE if stdin is not None else None,
        stdout=subprocess.PIPE if stdout else None,
        stderr=subprocess.PIPE if stderr else None, text=True, start_new_session=True)
  except FileNotFoundError:
    raise UserError(f"{argv[0]} not found: run this launcher where the scheduler's "
                    f"commands are installed and on PATH") from None
  try:
    out, err = process.communicate(stdin, timeout=limit)
  except subprocess.TimeoutExpired:
    _stop(process)
    raise UserError(_no_answer(argv, limit)) from None
  except BaseException:   # Ctrl-C: the command goes with the launcher
    _stop(process)
    raise
  return subprocess.CompletedProcess(list(argv), process.returncode, out, err)


def _stop(process: subprocess.Popen) -> None:
  """Kills the command's process group (it may have started helpers) and reaps it."""
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  process.communicate()


def _no_answer(argv: Sequence[str], limit: float) -> str:
  """The one line for a command that did not end in time: a submission may have reached
  the scheduler all the same, so the user looks before submitting again."""
  check = _CHECKS.get(argv[0], "the scheduler")
  return (f"{argv[0]} did not answer in {limit:g} s: is {check} up? A submission may "
          f"have gone through all the same: look at the queue before submitting again. "
          f"To let it take longer, set {TIMEOUT_ENV} (seconds)")
