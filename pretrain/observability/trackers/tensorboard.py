"""TensorBoard event files in `workdir/tensorboard`, through clu's metric writer.

Step rows only, under the names `metrics.jsonl` uses (`loss`, `eval_loss`,
`downstream/<task>/<metric>`), finite values only: what the writer wrote before trackers
existed, so existing dashboards keep working. `tensorboard --logdir workdirs/` reads them.
"""
from __future__ import annotations

import math
import shutil
import tempfile
import time
from typing import Any, Mapping, Optional, Sequence

from etils import epy

from plumbing import storage
from plumbing.errors import StorageOutageError
from pretrain.observability.trackers import STEP_KINDS, Row, RunInfo, TrackerContext
from pretrain.checkpoints.outage import Uploads
from pretrain.run_directory import RunDirectory

# clu's TensorBoard writer imports TensorFlow (about 6 s): loaded when a run first
# writes events, not by every command that imports this module.
with epy.lazy_imports():
  from clu import metric_writers



class _UploadedTensorBoard:
  """TensorBoard events for an object-storage workdir: TensorFlow's event writer cannot
  reach every store (no s3://, no emulator endpoints), so events go to a local staging
  directory and are copied to `workdir/tensorboard` at most every `every_s` seconds and
  on close (each upload replaces the previous copy of a file whole), in the background
  (`Uploads`)."""

  def __init__(self, destination: str, uploads: Uploads, every_s: float = 60.0):
    self._destination = destination
    self._uploads = uploads
    self._staging = tempfile.mkdtemp(prefix="griffin_tensorboard_")
    self._writer = metric_writers.SummaryWriter(self._staging)
    self._every_s = every_s
    self._uploaded_at = time.monotonic()

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    self._writer.write_scalars(step, scalars)
    if time.monotonic() - self._uploaded_at >= self._every_s:
      self._upload()

  def _upload(self) -> None:
    self._writer.flush()
    staging, destination = self._staging, self._destination
    try:
      self._uploads.submit(destination, lambda: storage.upload_tree(staging, destination))
    except StorageOutageError:
      return   # the run stops for it (its own writes raise it too) and says so
    self._uploaded_at = time.monotonic()

  def flush(self) -> None:
    self._upload()

  def close(self) -> None:
    """Uploads the events a last time, waiting as a session's end waits for its writes
    (`Uploads.drain`: not at all for a storage that does not answer); the staging
    directory stays when the upload has not landed by then (it reads from there)."""
    self._writer.close()
    self._upload()
    if self._uploads.drain():
      shutil.rmtree(self._staging, ignore_errors=True)


class TensorBoardTracker:
  """The `tensorboard` tracker (the default): event files beside `metrics.jsonl`."""
  name = "tensorboard"
  where = ""

  def __init__(self, context: TrackerContext):
    self._events = RunDirectory(context.workdir).tensorboard
    self._uploads = context.uploads
    self._writer: Any = None

  def open(self, run: RunInfo, run_id: Optional[str], last_step: int) -> Optional[str]:
    del run, run_id, last_step
    self._writer = (_UploadedTensorBoard(self._events, self._uploads) if self._uploads
                    else metric_writers.SummaryWriter(self._events))
    return None

  def log(self, rows: Sequence[Row]) -> None:
    for row in rows:
      if row.kind in STEP_KINDS:
        self._writer.write_scalars(row.step, {
            name: float(value) for name, value in row.values.items()
            if isinstance(value, (int, float)) and math.isfinite(value)})

  def close(self, summary: Mapping[str, Any], failed: bool) -> None:
    del summary, failed
    if isinstance(self._writer, _UploadedTensorBoard):
      self._writer.close()
    else:
      self._writer.flush()
      self._writer.close()
