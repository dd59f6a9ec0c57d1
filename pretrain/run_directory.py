"""Where each part of a training run lives: `RunDirectory`, the one owner of the layout.

A run directory (`--workdir`; a local path or a `gs://` / `s3://` URL) holds

  checkpoints/      the persistent checkpoint tier, one directory per step
  metrics.jsonl     every metrics row (`pretrain.observability.metrics`)
  config.gin        the operative Gin config the run trained with
  model.gin         the model a converted checkpoint implies (`pretrain.convert`)
  trackers.json     what each experiment tracker was sent, and its run id
  tensorboard/      the TensorBoard tracker's event files
  profile/          JAX profiler traces (`TrainConfig.profile_steps`)
  hangs/            the watchdog's stack dumps (local workdirs; a bucket's go to a local
                    temporary directory, since the storage may be what hangs)
  clients.log       what the clients of outside services (trackers, object storage)
                    logged: retries, tracebacks (`plumbing.quiet.keep_client_logs`;
                    for a bucket workdir, a local temporary file, as for hangs/)

and, on each host, a local counterpart under `CheckpointConfig.local_dir`:
`<local_dir>/<run key>/process_<i>_of_<n>` (the local checkpoint tier) and, beside it,
`metrics.unsent.jsonl` (the metric rows a bucket did not take when an outage stopped
the run). Every module asks this object for a path instead of joining names itself or
deriving one from another object's directory.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from typing import Optional

import jax
from etils import epath

from plumbing import storage

METRICS = "metrics.jsonl"
CONFIG = "config.gin"
TRACKERS_STATE = "trackers.json"
UNSENT_METRICS = "metrics.unsent.jsonl"
CLIENT_LOG = "clients.log"


@dataclasses.dataclass(frozen=True)
class RunDirectory:
  """The layout of one run directory (see the module docstring).

  Attributes:
    root: the workdir, resolved (`storage.resolve`: absolute, or the URL unchanged).
    local_dir: the host-local directory of the run's local tier
      (`CheckpointConfig.local_dir`); None without one.
  """
  root: str
  local_dir: Optional[str] = None

  def __post_init__(self):
    object.__setattr__(self, "root", storage.resolve(self.root))

  def path(self, *names: str) -> str:
    """`root/name/...`."""
    return storage.join(self.root, *names)

  @property
  def checkpoints(self) -> epath.Path:
    """The persistent tier's directory, absolute: Orbax's tensorstore (OCDBT) layer
    rejects relative paths."""
    return storage.as_path(self.path("checkpoints"))

  @property
  def metrics(self) -> str:
    return self.path(METRICS)

  @property
  def config(self) -> str:
    return self.path(CONFIG)

  @property
  def model_gin(self) -> str:
    return self.path("model.gin")

  @property
  def trackers_state(self) -> str:
    return self.path(TRACKERS_STATE)

  @property
  def tensorboard(self) -> str:
    return self.path("tensorboard")

  @property
  def profile(self) -> str:
    return self.path("profile")

  @property
  def hangs(self) -> str:
    """Where hang dumps go: `root/hangs` on a local workdir; for a bucket, a local
    directory (a dump must not depend on the storage that may be what hangs)."""
    if not storage.is_url(self.root):
      return self.path("hangs")
    return os.path.join(tempfile.gettempdir(), "griffin-hangs")

  @property
  def client_log(self) -> str:
    """Where the client libraries' log records go (`plumbing.quiet.keep_client_logs`):
    `root/clients.log` on a local workdir; for a bucket, a local file (an object store
    cannot append, and the storage may be the service that fails)."""
    if not storage.is_url(self.root):
      return self.path(CLIENT_LOG)
    key = hashlib.sha1(self.root.encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"griffin-clients-{key}.log")

  @property
  def local_run(self) -> Optional[epath.Path]:
    """`local_dir/<run key>`: this run's part of the local directory, shared by its
    processes on the host (None without a local directory). The key hashes the
    workdir, so runs sharing `/dev/shm` never mix."""
    if not self.local_dir:
      return None
    run_key = hashlib.sha1(os.path.abspath(self.root).encode()).hexdigest()[:12]
    return epath.Path(os.path.abspath(os.path.expanduser(self.local_dir))) / run_key

  @property
  def local_tier(self) -> Optional[epath.Path]:
    """This process's local tier directory, `local_run/process_<i>_of_<n>`: processes
    sharing a machine never mix, and a different process count never restores it."""
    run = self.local_run
    return None if run is None else (
        run / f"process_{jax.process_index()}_of_{jax.process_count()}")

  @property
  def unsent_metrics(self) -> Optional[str]:
    """Where a bucket run stopped by an outage keeps the metric rows the bucket did not
    take (beside its local tier; None without one)."""
    run = self.local_run
    return None if run is None else str(run / UNSENT_METRICS)
