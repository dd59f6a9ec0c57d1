"""Runs N cooperating JAX processes on this machine, each a simulated multi-device host.

  python -m launch.local --num_processes=2 --devices_per_process=4 -- \\
      python -m pretrain.train --gin_file=configs/quickstart.gin --workdir=/tmp/run

Each process gets the coordinator address, process count and id in its environment
(see `sharding.distributed`), runs on CPU with `--devices_per_process` simulated devices,
and talks to the others over gloo: the same code path as a real multi-host job. Output
lines are prefixed with the process index. If any process fails, the others are stopped
and the launcher exits non-zero naming the process that failed first.
"""
from __future__ import annotations

from pretrain import quiet  # pylint: disable=unused-import  # first: see its docstring
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from absl import flags

from launch import common
from pretrain import cli
from pretrain.errors import usage_error

_POLL_S = 0.05
_TERMINATE_GRACE_S = 5.0


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


def run(command: Sequence[str], num_processes: int, devices_per_process: int = 1,
        port: Optional[int] = None) -> int:
  """Runs `command` as `num_processes` cooperating processes; returns the exit status."""
  if num_processes < 1 or devices_per_process < 1:
    raise usage_error("--num_processes and --devices_per_process must be >= 1")
  coordinator = f"127.0.0.1:{port or common.free_port()}"
  lock = threading.Lock()
  processes, pumps = [], []
  base_flags = os.environ.get("XLA_FLAGS", "")
  for index in range(num_processes):
    env = dict(os.environ)
    env.update(common.local_process_env(coordinator, num_processes, index,
                                        devices_per_process, base_flags))
    env["PYTHONUNBUFFERED"] = "1"
    process = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    processes.append(process)
    pump = threading.Thread(target=_pump, args=(index, process.stdout, lock), daemon=True)
    pump.start()
    pumps.append(pump)

  def forward(signum, _frame):
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
  if failed is None:
    return 0
  code = processes[failed].returncode
  others = num_processes - 1
  sys.stderr.write(f"launch.local: process {failed} of {num_processes} {_describe(code)}; "
                   f"stopped the other {others} process{'es' if others != 1 else ''}\n")
  sys.stderr.flush()
  return code if 0 < code < 256 else 1


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Command-line flags, defined only when run as a program (see tests/test_entry_points)."""
  common.stop_flags_at_command()
  flags.DEFINE_integer("num_processes", None, "Processes (simulated hosts) to start.",
                       lower_bound=1)
  flags.DEFINE_integer("devices_per_process", 1, "Simulated CPU devices in each process.",
                       lower_bound=1)
  flags.DEFINE_integer("port", None, "Coordinator port on 127.0.0.1 (default: a free one).",
                       lower_bound=1, upper_bound=65535)
  flags.mark_flag_as_required("num_processes")


def main(argv: Sequence[str]) -> None:
  command = common.child_command(argv)
  sys.exit(run(command, FLAGS.num_processes, FLAGS.devices_per_process, FLAGS.port))


if __name__ == "__main__":
  define_flags()
  cli.run(main)
