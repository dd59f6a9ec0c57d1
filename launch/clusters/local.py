"""Runs N cooperating JAX processes on this machine, each a simulated multi-device host.

The library of `python -m launch.local` (launch/local.py, whose docstring is the
command's manual; its flags and main are there).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence


from launch.clusters import common
from plumbing.errors import UserError, usage_error

_POLL_S = 0.05
# A peer has failed: the survivors can no longer finish a collective (a save included),
# and one left blocked there (or in JAX's shutdown, waiting for the dead peer) only
# delays the restart: 1 s to exit on SIGTERM, then SIGKILL. Measured on the tiny
# trainer (2 processes, process 1 killed): the survivor took the whole grace, 5.2 s
# when it was 5 s.
_TERMINATE_GRACE_S = 1.0
_PORT_FREE_TIMEOUT_S = 60.0
# Restarts back off like a crash loop: an attempt that fails soon after it started (a
# bucket that is still down, a node still rebooting) would otherwise spend the whole
# restart budget in seconds. The pause doubles with each attempt in a row that ran less
# than _BACKOFF_RESET_S, up to _MAX_BACKOFF_S; an attempt that ran longer starts again
# from the first pause.
_BACKOFF_RESET_S = 60.0
_MAX_BACKOFF_S = 60.0


def _pump(index: int, stream, lock: threading.Lock) -> None:
  """Copies a child's output to ours, line by line, prefixed with its index."""
  for raw in iter(stream.readline, b""):
    line = raw.decode("utf-8", errors="replace").rstrip("\n")
    with lock:
      sys.stdout.write(f"[{index}] {line}\n")
      sys.stdout.flush()
  stream.close()


def _stop(processes: Sequence[subprocess.Popen]) -> None:
  """SIGTERM every running child's process group, then SIGKILL what is left."""
  running = [p for p in processes if p.poll() is None]
  for p in running:
    try:
      os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
      pass
  deadline = time.monotonic() + _TERMINATE_GRACE_S
  for p in running:
    try:
      p.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      p.wait()


def _describe(code: int) -> str:
  if code < 0:
    try:
      return f"was killed by signal {signal.Signals(-code).name}"
    except ValueError:
      return f"was killed by signal {-code}"
  return f"exited with code {code}"


def _port_is_free(port: int) -> bool:
  """Whether a new coordinator can listen on `port`. Like the coordinator's gRPC server,
  the probe sets SO_REUSEADDR: connections of the stopped run linger in TIME_WAIT for a
  minute and do not stop a listener, only a socket still listening does."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      sock.bind(("127.0.0.1", port))
    except OSError:
      return False
  return True


def _wait_for_port(port: int, timeout_s: float = _PORT_FREE_TIMEOUT_S) -> None:
  """Blocks until the coordinator port can be bound again (the dead coordinator's socket
  may linger), so the next attempt's coordinator does not fail to start."""
  deadline = time.monotonic() + timeout_s
  while not _port_is_free(port):
    if time.monotonic() > deadline:
      raise UserError(f"launch.local: coordinator port {port} is still in use "
                      f"{timeout_s:.0f} s after the processes stopped; pass a free --port")
    time.sleep(0.2)


def _attempt(command: Sequence[str], num_processes: int, devices_per_process: int,
             coordinator: str, attempt: int) -> tuple[Optional[int], int, bool]:
  """Runs every process once. Returns (index of the first failed process or None, its
  exit code, whether the launcher itself was signalled)."""
  lock = threading.Lock()
  processes, pumps = [], []
  base_flags = os.environ.get("XLA_FLAGS", "")
  for index in range(num_processes):
    env = dict(os.environ)
    env.update(common.local_process_env(coordinator, num_processes, index,
                                        devices_per_process, base_flags))
    env["PYTHONUNBUFFERED"] = "1"
    env[common.ENV_RESTART_ATTEMPT] = str(attempt)
    process = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    processes.append(process)
    pump = threading.Thread(target=_pump, args=(index, process.stdout, lock), daemon=True)
    pump.start()
    pumps.append(pump)

  signalled = []

  def forward(signum, _frame):
    signalled.append(signum)
    for p in processes:
      if p.poll() is None:
        os.killpg(p.pid, signum)
  previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  failed = None
  try:
    while True:
      codes = [p.poll() for p in processes]  # poll every child, every round
      failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
      if failed is not None or all(code == 0 for code in codes):
        break
      time.sleep(_POLL_S)
    if failed is not None:
      _stop(processes)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    for pump in pumps:
      pump.join(timeout=2.0)
  code = 0 if failed is None else processes[failed].returncode
  return failed, code, bool(signalled)


def restart_delay_s(quick_failures: int, backoff_s: float) -> float:
  """The pause before a restart after `quick_failures` (>= 1) attempts in a row that each
  ran less than _BACKOFF_RESET_S: `backoff_s`, doubled for each one before, at most
  _MAX_BACKOFF_S."""
  return min(_MAX_BACKOFF_S, backoff_s * 2 ** (max(quick_failures, 1) - 1))


def run(command: Sequence[str], num_processes: int, devices_per_process: int = 1,
        port: Optional[int] = None, max_restarts: int = 0,
        restart_backoff_s: float = 1.0) -> int:
  """Runs `command` as `num_processes` cooperating processes; returns the exit status.

  When a process fails, the others are stopped; with `max_restarts` > 0 all of them are
  then started again on the same coordinator port (once it is free), up to that many
  times, so a trainer resumes from its newest checkpoint without a person. Each restart
  waits `restart_delay_s` first (0 when `restart_backoff_s` is 0). A signal to the
  launcher itself (Ctrl-C, SIGTERM) is forwarded and never restarts anything.
  """
  if num_processes < 1 or devices_per_process < 1:
    raise usage_error("--num_processes and --devices_per_process must be >= 1")
  if max_restarts < 0 or restart_backoff_s < 0:
    raise usage_error("--max_restarts and --restart_backoff_s must be >= 0")
  port = port or common.free_port()
  coordinator = f"127.0.0.1:{port}"
  others = num_processes - 1
  quick_failures = 0
  for attempt in range(max_restarts + 1):
    started = time.monotonic()
    failed, code, signalled = _attempt(command, num_processes, devices_per_process,
                                       coordinator, attempt)
    if failed is None:
      return 0
    sys.stderr.write(f"launch.local: process {failed} of {num_processes} {_describe(code)}; "
                     f"stopped the other {others} process{'es' if others != 1 else ''}\n")
    if signalled or attempt == max_restarts:
      break
    ran_s = time.monotonic() - started
    quick_failures = quick_failures + 1 if ran_s < _BACKOFF_RESET_S else 1
    delay_s = restart_delay_s(quick_failures, restart_backoff_s)
    sys.stderr.write(f"launch.local: restart {attempt + 1} of {max_restarts} in "
                     f"{delay_s:g} s (attempt ran {ran_s:.1f} s)\n")
    sys.stderr.flush()
    time.sleep(delay_s)
    _wait_for_port(port)
  sys.stderr.flush()
  return code if 0 < code < 256 else 1
