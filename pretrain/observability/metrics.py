"""Where training metrics go: `metrics.jsonl`, the console, and the experiment trackers.

Only process 0 writes (every process computes the same replicated scalars). The writer
receives plain Python numbers: fetching them from the device is the train loop's job,
which does it one step late so that the device never waits for the host. Every row
written to the file also goes to the run's trackers (TensorBoard, W&B, MLflow:
`pretrain.observability.trackers`). The console line is our own rather than clu's
`periodic_actions.ReportProgress`, which logs at INFO and times wall clock between calls,
evaluations and checkpoint saves included; `StepTimer` times training steps only.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Iterable, Iterator, Mapping, Optional, Sequence, TextIO, TypeVar

import jax

from plumbing import storage
from plumbing.errors import warn
from pretrain.observability.trackers import (DOWNSTREAM, EVAL, STEP_RECORD_KINDS, TRAIN,
                                             Row, RunInfo, TrackerContext)
from pretrain.observability.trackers.rows import from_json as tracker_row
from pretrain.observability.trackers.delivery import Trackers
from pretrain.checkpoints.outage import (EXIT_FLUSH_S, FLUSH_TIMEOUT_S, StorageConfig,
                                         Uploads)
from pretrain.run_directory import RunDirectory

T = TypeVar("T")
# Names of downstream task metrics start with this (`pretrain.evaluation.downstream`).
DOWNSTREAM_PREFIX = "downstream/"


def format_duration(seconds: float) -> str:
  """'1h02m', '7m30s', '42s'."""
  seconds = max(0, int(round(seconds)))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  if hours:
    return f"{hours}h{minutes:02d}m"
  if minutes:
    return f"{minutes}m{secs:02d}s"
  return f"{secs}s"


def progress_line(step: int, total_steps: int, row: Mapping[str, float]) -> str:
  """The console line of a logged step (MFU 'n/a' when the device peak is unknown)."""
  mfu = row.get("mfu")
  remaining = (total_steps - step) * row["step_time_s"]
  return (f"step {step}/{total_steps} | loss {row['loss']:.4f} | "
          f"lr {row['learning_rate']:.3e} | {row['tokens_per_second']:,.0f} tok/s | "
          f"{row['step_time_s']:.3f} s/step | "
          f"MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
          f"ETA {format_duration(remaining)}")


def with_progress(items: Iterable[T], total: int, label: str, *, every_s: float = 5.0,
                  stream: TextIO = sys.stderr) -> Iterator[T]:
  """Yields `items`, printing 'label: i/total (p%), ETA ...' about every `every_s`
  seconds and once at the end, so a long pass is never silent."""
  started = last = time.perf_counter()
  done = 0
  for done, item in enumerate(items, start=1):
    yield item
    now = time.perf_counter()
    if now - last >= every_s and done < total:
      last = now
      eta = (now - started) / done * (total - done)
      print(f"{label}: {done}/{total} ({100 * done // total}%), ETA {format_duration(eta)}",
            file=stream, flush=True)
  print(f"{label}: {done}/{total} in {format_duration(time.perf_counter() - started)}",
        file=stream, flush=True)


class _LocalJsonl:
  """metrics.jsonl on a local disk: appended line by line, flushed after each."""

  def __init__(self, path: str):
    self._path = path
    self._file = open(path, "a", encoding="utf-8")

  def append(self, line: str) -> None:
    self._file.write(line)
    self._file.flush()

  def lines(self) -> list[str]:
    with open(self._path, encoding="utf-8") as f:
      return list(f)

  def replace(self, lines: list[str]) -> None:
    self._file.close()
    storage.write_text(self._path, "".join(lines))  # atomic: temporary file renamed
    self._file = open(self._path, "a", encoding="utf-8")

  def close(self) -> None:
    self._file.close()


class _ObjectJsonl:
  """metrics.jsonl on object storage, which cannot append: the rows are kept in memory
  and every change uploads the whole object, an atomic put, so a reader (or a resumed
  run) sees every row written so far or the previous version, never a torn line. A log
  row costs one upload of the file (tens of bytes per row), made in the background
  (`Uploads`: retried while the storage is down, a newer version replacing a queued
  one)."""

  def __init__(self, path: str, uploads: Uploads):
    self._path = path
    self._uploads = uploads
    self._lines = storage.read_text(path).splitlines(True) if storage.exists(path) else []

  def _upload(self) -> None:
    path, text = self._path, "".join(self._lines)
    self._uploads.submit(path, lambda: storage.write_text(path, text))

  def append(self, line: str) -> None:
    self._lines.append(line)
    self._upload()

  def lines(self) -> list[str]:
    return list(self._lines)

  def replace(self, lines: list[str]) -> None:
    self._lines = list(lines)
    self._upload()

  def close(self) -> None:
    pass


class MetricsWriter:
  """Writes metric rows to `workdir/metrics.jsonl` and the trackers; prints progress.

  A resumed run continues the same file; a row's `step` says which step it belongs to.
  `rewind(step)` first drops the rows of steps after the restored checkpoint (they are
  about to be trained again), and an evaluation of a step already in the file is printed
  but not written again, so the file never holds two rows of the same kind for one step,
  however often a run is stopped and rerun. On a local disk rows are appended; in a
  `gs://` / `s3://` workdir the file is rewritten whole (`_ObjectJsonl`).
  Rows with a `kind` field (`pretrain.observability.goodput`: goodput, restart) are records of
  sessions; they are written with `log_record` and never dropped by `rewind`, except the
  kinds that belong to a step (`STEP_RECORD_KINDS`: a mixture's token shares), which
  `rewind` drops with their step's metrics.

  `unsent_path` (a local file; the trainer passes one beside its local checkpoint
  tier): a bucket run that stops while the storage is down writes the rows the bucket
  has not taken there, and the next run sends them (`_send_unsent`), so an outage
  stop loses no row of the steps it saved locally; the trackers get those rows from the
  file when the next run starts them.

  `trackers`: the registered names of the trackers that get every row written
  (`TrainConfig.trackers`); they start with `start_trackers` (or the first row).
  `tracker_exit_wait_s`: the longest `close` waits for a tracker call without an answer
  (`TrainConfig.tracker_exit_wait_s`; `delivery.EXIT_WAIT_S` unless given).
  """

  def __init__(self, workdir: str, total_steps: int, *,
               trackers: Sequence[str] = ("tensorboard",), stream: Optional[TextIO] = None,
               storage_config: StorageConfig = StorageConfig(),
               unsent_path: Optional[str] = None,
               tracker_exit_wait_s: Optional[float] = None):
    self._enabled = jax.process_index() == 0
    self._workdir = workdir
    self._total_steps = total_steps
    self._stream = stream or sys.stdout   # the one at the time (tests redirect it)
    self._jsonl = None
    self._trackers: Optional[Trackers] = None
    self._uploads: Optional[Uploads] = None
    self._eval_steps: set[int] = set()
    self._downstream_steps: set[int] = set()
    self._unsent_path: Optional[str] = None
    if not self._enabled:
      return
    path = RunDirectory(workdir).metrics
    if storage.is_url(workdir):
      self._uploads = Uploads(storage_config.outage_s)
      self._jsonl = _ObjectJsonl(path, self._uploads)
      self._unsent_path = unsent_path
      self._send_unsent()
    else:
      self._jsonl = _LocalJsonl(path)
    self._trackers = Trackers(trackers, TrackerContext(workdir, self._uploads),
                              info=self._line, exit_wait_s=tracker_exit_wait_s)

  def _send_unsent(self) -> None:
    """Adopts the rows a run stopped by an outage kept locally, when the bucket's file
    is where that run's began (a prefix of the kept one: the usual case, the outage
    came after this run's first upload); otherwise the kept file is set aside, not
    merged, since the bucket's file has rows that run never saw."""
    if not self._unsent_path or not os.path.exists(self._unsent_path):
      return
    with open(self._unsent_path, encoding="utf-8") as f:
      kept = f.read().splitlines(True)
    current = self._jsonl.lines()
    if kept[:len(current)] == current:
      self._jsonl.replace(kept)
      os.remove(self._unsent_path)
      print(f"metrics.jsonl: {len(kept) - len(current)} row(s) the last run logged while "
            f"the storage was down, kept in {self._unsent_path}, sent now",
            file=self._stream, flush=True)
    else:
      aside = f"{self._unsent_path}.unmerged"
      os.replace(self._unsent_path, aside)
      warn(f"the metric rows kept in {self._unsent_path} by a run stopped by an outage "
           f"do not continue the bucket's metrics.jsonl (it changed since): set aside "
           f"as {aside}, not merged")

  def _keep_unsent(self) -> str:
    """Writes the whole file, as the bucket should have it, to `unsent_path`; returns
    what became of it, for the warning."""
    try:
      os.makedirs(os.path.dirname(self._unsent_path), exist_ok=True)
      storage.write_text(self._unsent_path, "".join(self._jsonl.lines()))
    except OSError as error:
      return f"and could not be kept in {self._unsent_path} ({error.strerror or error})"
    return f"kept in {self._unsent_path}: the next run sends them"

  def _write(self, kind: str, step: int, row: Mapping[str, Optional[float]]) -> None:
    values = {k: (None if v is None else float(v)) for k, v in row.items()}
    self._jsonl.append(json.dumps({"step": int(step), **values}) + "\n")
    self._keep_while_down()
    self._track(Row(kind, int(step), values))

  def _keep_while_down(self) -> None:
    """While the storage is down, keeps the file as the bucket should have it beside the
    local tier after every row, and drops that copy once the bucket has caught up.

    `close` keeps it too, but only a process that stops in order gets there: when
    another process meets the outage first and stops, the launcher ends this one (the
    writer of the rows) in the middle of its step, and the rows logged since the outage
    began would be lost."""
    if not self._unsent_path or self._uploads is None:
      return
    if self._uploads.outage.down_s() > 0:
      self._keep_unsent()
    elif os.path.exists(self._unsent_path) and self._uploads.flush(0):
      os.remove(self._unsent_path)

  def start_trackers(self, run: Optional[RunInfo] = None) -> None:
    """Starts the trackers' runs (`RunInfo`: its config, the model card's facts; None:
    named after the workdir, nothing else) and offers them the rows already written,
    which they get unless they have them (process 0; nothing elsewhere)."""
    if self._trackers is not None and not self._trackers.started:
      self._trackers.start(run or RunInfo(self._workdir.rstrip("/").rsplit("/", 1)[-1]),
                           self.read_rows())

  def _track(self, row: Row) -> None:
    if not self._trackers.started:
      self.start_trackers()   # offers the file, this row included
    else:
      self._trackers.log(row)

  def _line(self, text: str) -> None:
    """A console line written whole, also from a tracker's thread."""
    self._stream.write(text + "\n")
    self._stream.flush()

  def rewind(self, step: int) -> list[dict]:
    """Drops the metric rows of steps after `step` (and a half-written last line): the
    run continues from the checkpoint of `step`, so those steps are logged again.
    Records with a `kind` (goodput, restart) describe sessions, not steps, and stay
    (but for `STEP_RECORD_KINDS`). Returns the dropped rows (on process 0; [] elsewhere)."""
    if not self._enabled:
      return []
    kept, dropped = [], []
    for line in self._jsonl.lines():
      if not line.endswith("\n"):
        continue  # a half-written last line
      row = json.loads(line)
      session = "kind" in row and row["kind"] not in STEP_RECORD_KINDS
      (kept if session or row["step"] <= step else dropped).append((line, row))
    self._jsonl.replace([line for line, _ in kept])
    self._eval_steps = {row["step"] for _, row in kept if "eval_loss" in row}
    self._downstream_steps = {row["step"] for _, row in kept if _is_downstream(row)}
    return [row for _, row in dropped]

  def read_rows(self) -> list[dict]:
    """Every complete row of the file (process 0; [] elsewhere)."""
    if not self._enabled:
      return []
    return [json.loads(line) for line in self._jsonl.lines() if line.endswith("\n")]

  def log_record(self, record: Mapping[str, object]) -> None:
    """Writes a row with a `kind` (goodput, restart): not a step's metrics, so it goes
    to the file only and survives `rewind`."""
    if self._enabled:
      self._jsonl.append(json.dumps(dict(record)) + "\n")
      self._keep_while_down()
      self._track(tracker_row(record))

  def log_train(self, step: int, row: Mapping[str, Optional[float]]) -> None:
    """A training row: loss, learning_rate, tokens_per_second, step_time_s, mfu, ..."""
    if not self._enabled:
      return
    self._write(TRAIN, step, row)
    print(progress_line(step, self._total_steps, row), file=self._stream, flush=True)

  def log_eval(self, step: int, eval_loss: float, tokens: int,
               bits_per_byte: Optional[float] = None) -> None:
    """An evaluation row: eval_loss, eval_tokens and, where the vocabulary has text,
    eval_bits_per_byte (left out otherwise, not written as null)."""
    if not self._enabled:
      return
    row = {"eval_loss": eval_loss, "eval_tokens": tokens}
    if bits_per_byte is not None:
      row["eval_bits_per_byte"] = bits_per_byte
    if step not in self._eval_steps:  # a rerun of a finished run evaluates it again
      self._write(EVAL, step, row)
      self._eval_steps.add(step)
    per_byte = "" if bits_per_byte is None else f" | eval_bits_per_byte {bits_per_byte:.4f}"
    print(f"step {step}/{self._total_steps} | eval_loss {eval_loss:.4f}{per_byte} "
          f"({tokens:,} tokens)", file=self._stream, flush=True)

  def log_downstream(self, step: int, values: Mapping[str, float]) -> None:
    """Downstream task metrics (`downstream/<task>/<metric>`, `pretrain.evaluation.downstream`):
    one row per step, like evaluations."""
    if not self._enabled:
      return
    if step not in self._downstream_steps:
      self._write(DOWNSTREAM, step, values)
      self._downstream_steps.add(step)
    scores = ", ".join(f"{name.split('/', 1)[-1]} {value:.4f}"
                       for name, value in values.items())
    print(f"step {step}/{self._total_steps} | {scores}", file=self._stream, flush=True)

  def info(self, message: str) -> None:
    if self._enabled:
      print(message, file=self._stream, flush=True)

  def close(self, flush_timeout_s: float = FLUSH_TIMEOUT_S, failed: bool = False) -> None:
    """Closes the files and ends the trackers' sessions (`failed`: the run stopped with
    an error); waits up to `flush_timeout_s` for the trackers that answer and, in a
    bucket workdir, for the writes still queued (`Uploads.drain`: not at all when the
    storage does not answer its 2 s probe, else at most `EXIT_FLUSH_S`, seconds rather
    than the clients' retries), then keeps the rows the storage has not taken in
    `unsent_path` with one line. A run that stops because the storage does not answer
    passes 0: a write in flight can take the storage client's own retries (gcsfs:
    about 36 s) to fail."""
    if self._jsonl is not None:
      self._jsonl.close()
    if self._trackers is not None:
      self._trackers.close(flush_timeout_s, failed)
    if self._uploads is not None:
      if not self._uploads.drain(min(flush_timeout_s, EXIT_FLUSH_S)):
        down_s = self._uploads.outage.down_s()
        kept = f"; the metric rows are {self._keep_unsent()}" if self._unsent_path else ""
        warn("metrics and TensorBoard writes " + (f"of the last {down_s:.0f} s " if down_s
                                                  else "still queued ")
             + "did not reach the storage" + kept)
      elif self._unsent_path and os.path.exists(self._unsent_path):
        os.remove(self._unsent_path)   # kept during an outage the bucket has caught up on
      self._uploads.close(timeout_s=0)


def _is_downstream(row: Mapping[str, object]) -> bool:
  return any(name.startswith(DOWNSTREAM_PREFIX) for name in row)


class StepTimer:
  """Wall time per step between two points where the device was known to be done.

  The loop calls `mark(step)` right after fetching step `step`'s metrics (which waits
  for that step), so the interval covers whole steps of device work, not dispatch.
  """

  def __init__(self):
    self._last: Optional[tuple[int, float]] = None

  def mark(self, step: int) -> Optional[float]:
    """Seconds per step since the previous mark, or None on the first mark."""
    now = time.perf_counter()
    previous, self._last = self._last, (step, now)
    if previous is None or step <= previous[0]:
      return None
    return (now - previous[1]) / (step - previous[0])

  def restart(self, step: int) -> None:
    """Marks `step` without measuring: time spent since (an eval, a save) is no step's."""
    self._last = (step, time.perf_counter())
