"""Joining JAX's multi-controller runtime from the environment a launcher set up.

Every entry point calls `initialize_from_environment()` before touching devices:

* `launch.local` (and anything else that sets them) passes JAX_COORDINATOR_ADDRESS,
  JAX_NUM_PROCESSES and JAX_PROCESS_ID; processes then meet at that coordinator, and on
  CPU their collectives run over gloo.
* On Cloud TPU VMs, GKE TPU pods, SLURM and Open MPI, JAX reads the cluster's own
  environment, so nothing needs to be passed.
* Otherwise (one process on a laptop or a single host) nothing happens.

Failure detection is tightened from JAX's defaults (100 s heartbeats, 300 s shutdown
barrier), so that when a peer dies the survivors are told by the coordinator and abort
within `heartbeat_timeout_s` instead of blocking in a collective forever.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Iterator

import jax
from jax._src import cache_key  # private: the persistent cache's key (see share_cpu_compilation_cache)
from jax._src import clusters  # private: cluster auto-detection has no public API
from jax._src import distributed as jax_distributed  # private: whether the notifier runs

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def _cluster_detected() -> bool:
  """Whether JAX's cluster auto-detection (TPU VM/GKE, SLURM, Open MPI) applies here."""
  for env in clusters.ClusterEnv._cluster_types:  # pylint: disable=protected-access
    if not env.opt_in_only_method and env.is_env_present():
      return True
  return False


def _read_int(name: str) -> int:
  value = os.environ[name]
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"Environment variable {name} must be an integer, got {value!r}") from None


def initialize_from_environment(heartbeat_timeout_s: int = 15,
                                shutdown_timeout_s: int = 30,
                                initialization_timeout_s: int = 300,
                                cpu_collectives: str = "gloo") -> bool:
  """Calls `jax.distributed.initialize` when the environment describes several processes.

  Must run before any other JAX call that touches devices. Idempotent.

  Args:
    heartbeat_timeout_s: a process that sends no heartbeat for this long is declared
      dead, and every other process is then stopped with an error.
    shutdown_timeout_s: how long a finishing process waits at the exit barrier for
      the others.
    initialization_timeout_s: how long processes wait for each other at start-up.
    cpu_collectives: cross-process collectives on CPU ("gloo" or "mpi").

  Returns:
    True if this process is part of a multi-process run.
  """
  if jax.distributed.is_initialized():
    return True
  timeouts = dict(heartbeat_timeout_seconds=heartbeat_timeout_s,
                  shutdown_timeout_seconds=shutdown_timeout_s,
                  initialization_timeout=initialization_timeout_s)
  explicit = [name for name in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
              if name in os.environ]
  if explicit:
    if len(explicit) != 3:
      raise ValueError(
          f"Only {explicit} of {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID} are "
          "set; a multi-process run needs all three (launch.local sets them)")
    num_processes = _read_int(ENV_NUM_PROCESSES)
    process_id = _read_int(ENV_PROCESS_ID)
    if num_processes == 1:
      return False
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    logging.info("Joining %d-process run as process %d via %s", num_processes, process_id,
                 os.environ[ENV_COORDINATOR])
    with _sigterm_held():
      jax.distributed.initialize(
          coordinator_address=os.environ[ENV_COORDINATOR], num_processes=num_processes,
          process_id=process_id, cluster_detection_method="deactivate", **timeouts)
    if os.environ.get("JAX_PLATFORMS") == "cpu":
      share_cpu_compilation_cache()
    return True
  if _cluster_detected():
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    with _sigterm_held():
      jax.distributed.initialize(**timeouts)
    if os.environ.get("JAX_PLATFORMS") == "cpu":
      share_cpu_compilation_cache()
    return jax.process_count() > 1
  return False


@contextlib.contextmanager
def _sigterm_held() -> Iterator[None]:
  """Keeps a SIGTERM that arrives while `jax.distributed.initialize` waits for the other
  processes (up to `initialization_timeout_s`) and delivers it once JAX's preemption
  notifier, which initialize installs, can take it: without this the default action
  would kill the process, and its peers with it, instead of saving at an agreed step."""
  if threading.current_thread() is not threading.main_thread():
    yield   # only the main thread may set handlers
    return
  received = []
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
  try:
    yield
  finally:
    if jax_distributed.global_state.preemption_sync_manager is None:
      signal.signal(signal.SIGTERM, previous)   # no notifier took over (failed, disabled)
    if received:
      logging.warning("SIGTERM during start-up: passing it to the preemption notifier")
      os.kill(os.getpid(), signal.SIGTERM)


def share_cpu_compilation_cache() -> None:
  """Lets every process of a multi-process CPU run (simulated hosts) read the persistent
  compilation cache that process 0 writes.

  JAX writes cache entries from process 0 only, and its cache key hashes the
  `accelerator_config`: on CPU the fingerprint of the topology of *this process's*
  devices, which differs between processes although every process compiles the same
  SPMD program (same HLO, compile options and global device assignment). So process 1
  never found an entry and compiled every program again in every session, while
  process 0 (all cache hits) waited for it inside the first collective. Measured with
  `JAX_EXPLAIN_CACHE_MISSES=1` on a 2 x 2 `launch.local` run: process 1 missed
  jit_init_fn, jit_step and ~30 others, process 0 none; under CPU load that lag was
  30-65 s per session (tests/test_multihost_train.py's chaos run has three sessions and
  timed out in CI). Hashing the kinds of the global devices instead gives every process
  process 0's key. (JAX strips the device assignment from GPU keys for the same reason.)
  """
  original = getattr(cache_key, "_hash_accelerator_config", None)
  if (original is None or not hasattr(cache_key, "_hash_devices")
      or getattr(original, "shared_across_processes", False)):
    return  # another JAX: keep its own keys (slower restarts, never a wrong hit)

  def hash_devices_of_any_process(hash_obj, accelerators):
    if all(device.platform == "cpu" for device in accelerators.flat):
      cache_key._hash_devices(hash_obj, accelerators)  # pylint: disable=protected-access
    else:
      original(hash_obj, accelerators)
  hash_devices_of_any_process.shared_across_processes = True
  cache_key._hash_accelerator_config = hash_devices_of_any_process  # pylint: disable=protected-access


def processes_on_one_machine() -> bool:
  """Whether every process of this run is on this machine: one process, or a
  coordinator on the loopback address (`launch.local`). Processes on one machine share
  its disk, so one of them may build a cache the others read."""
  return jax.process_count() == 1 or is_loopback(os.environ.get(ENV_COORDINATOR, ""))


def is_loopback(address: str) -> bool:
  """Whether a `host:port` coordinator address names this machine's loopback."""
  host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
  return host == "localhost" or host == "::1" or host.startswith("127.")
