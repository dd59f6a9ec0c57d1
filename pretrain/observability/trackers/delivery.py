"""Runs the trackers: each in a thread of its own, none able to stop or slow the run.

The training loop hands every row to `Trackers.log`, which only queues it. Each
tracker's thread opens the tracker's run, then sends what is queued. A tracker that
raises (a server down, no credentials, a network that is not there) costs one warning
line per session; its rows stay queued and are offered again after a backoff of 1, 2, 4,
... seconds (at most `MAX_BACKOFF_S`), so a tracker that answers again gets what it
missed, and one more line says so. Nothing waits for a tracker but `close`, and only
for one that answers: a call that has had no answer for `EXIT_WAIT_S` (a server that
accepts and never answers, a name that does not resolve, a client retrying on its own)
is left to its thread, which says nothing more, and the session ends.

`workdir/trackers.json` keeps, per tracker, its run's id and how far it has been sent:
the newest step of each step kind (train, eval, downstream, and the per-step `mixture`
records) and how many records (goodput, restart, straggler rows, in file order). A new session reopens the same run
and starts by offering the rows of `metrics.jsonl` (`start`): those a tracker has
already got are skipped, so rows a dead tracker missed reach it in a later session, and
a step that a restart trains again (after the newest checkpoint) is not sent twice: the
tracker keeps the values it got first (the file keeps the redone ones). Rows it still
lacks when a session ends are counted there (`unsent_rows`) and sent by the next.

A tracker whose client sends in the background (`confirms_at_close`: W&B, whose `log`
only hands rows to its service) has its rows counted sent only once its `close`
returns: until then `trackers.json` keeps its progress where the last confirmed session
left it, and a session whose `close` fails or does not answer counts every row it
handed over as unsent, so the next session sends them again. Such a tracker may also
bound its own end: an `exit_wait_s` attribute is set to the session end's bound before
`open`.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from plumbing import storage
from plumbing.errors import UserError, warn
from pretrain.observability import trackers as trackers_lib
from pretrain.observability.trackers import (EXIT_WAIT_S, STEP_KINDS, STEP_RECORD_KINDS,
                                             Row, RunInfo, Tracker, TrackerContext)
from pretrain.observability.trackers import rows as rows_lib
from pretrain.observability.trackers.mlflow_tracker import MlflowTracker
from pretrain.observability.trackers.run_info import Finals
from pretrain.observability.trackers.tensorboard import TensorBoardTracker
from pretrain.observability.trackers.wandb_tracker import WandbTracker
from pretrain.checkpoints.outage import Uploads
from pretrain.run_directory import TRACKERS_STATE, RunDirectory

for _builtin in (TensorBoardTracker, WandbTracker, MlflowTracker):
  trackers_lib.register(_builtin)

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0


def _socket_error(error: BaseException) -> Optional[BaseException]:
  """The innermost refused or reset connection, timeout or failed name lookup in
  `error`'s chain: clients wrap it in layers (MLflow's text quotes urllib3's whole
  retry state), and it is what the user needs to know."""
  found, seen = None, set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, (ConnectionError, TimeoutError, socket.gaierror)):
      found = error
    error = error.__cause__ or error.__context__
  return found


def _reason(error: BaseException, service: str) -> str:
  """One line for a failed call: the service that did not answer and why, or the
  service and the error's own text (a refusal: wrong credentials, no permission; the
  client's text says which, the service says where to fix it)."""
  cause = _socket_error(error)
  if cause is not None:
    return f"no answer from {service}: {_shortened(str(cause) or type(cause).__name__)}"
  return f"error from {service}: {_shortened(str(error) or type(error).__name__)}"


def _shortened(text: str) -> str:
  """`text` on one line, at most 300 characters (clients quote whole responses)."""
  text = " ".join(text.split())
  return text if len(text) <= 300 else text[:297] + "..."


def _client_log_note(workdir: str) -> str:
  """Where the client's own log records went (`RunDirectory.client_log`), when there
  are some."""
  path = RunDirectory(workdir).client_log
  return f"; its client's log: {path}" if os.path.exists(path) else ""


class _State:
  """`workdir/trackers.json`: per tracker, {"run_id", "sent": {kind: step},
  "records": n, "unsent_rows": n}. Each tracker's thread changes its own entry. In a
  bucket workdir it is written in the background (`Uploads`, newest version wins), so
  that no write waits for a bucket that is down."""

  def __init__(self, workdir: str, uploads: Optional[Uploads]):
    self._path = RunDirectory(workdir).trackers_state
    self._uploads = uploads
    self.lock = threading.Lock()   # held to change or read an entry
    self._writing = threading.Lock()   # one write at a time, the newest last
    self._data: dict[str, dict[str, Any]] = (json.loads(storage.read_text(self._path))
                                             if storage.exists(self._path) else {})

  def entry(self, name: str) -> dict[str, Any]:
    with self.lock:
      return self._data.setdefault(name, {"run_id": None, "sent": {}, "records": 0})

  def save(self) -> None:
    """Writes the file; a failure only means a later session may send a row again."""
    with self._writing:
      with self.lock:
        text = json.dumps(self._data, indent=1, sort_keys=True) + "\n"
      path = self._path
      try:
        if self._uploads is not None:
          self._uploads.submit(path, lambda: storage.write_text(path, text))
        else:
          storage.write_text(path, text)
      except (OSError, UserError):   # a full disk; a bucket down (the run says so)
        pass


class _Sender:
  """One tracker, its queue and its thread. Queue items are (row, ordinal): a record's
  place among the file's records, or None for a step row. `_progress` is what the
  tracker has confirmed (`trackers.json`'s entry), `_handed` what it was given: the
  same dict, except for a tracker that `confirms_at_close`."""

  def __init__(self, tracker: Tracker, state: _State, info: Callable[[str], None],
               workdir: str, exit_wait_s: float):
    self.tracker = tracker
    self.exit_wait_s = exit_wait_s
    self.workdir = workdir
    self.name = tracker.name
    self.service = getattr(tracker, "service", "") or f"the {self.name} service"
    self._state = state
    self._progress = state.entry(self.name)
    self._confirms_at_close = getattr(tracker, "confirms_at_close", False)
    self._handed = self._progress
    self._unconfirmed: list[tuple[Row, Optional[int]]] = []   # handed since confirmed
    if hasattr(tracker, "exit_wait_s"):   # a client that bounds its own end (W&B)
      tracker.exit_wait_s = exit_wait_s
    self._info = info
    self._cond = threading.Condition()
    self._queue: list[tuple[Row, Optional[int]]] = []
    self._closing: Optional[tuple[Mapping[str, Any], bool]] = None
    self._retry_at = 0.0
    self._backoff = FIRST_BACKOFF_S
    self._thread: Optional[threading.Thread] = None
    self.opened = False
    self.down = False      # the last attempt failed
    self.warned = False    # this session's warning line is spent
    self.calling_since: Optional[float] = None   # a call of the tracker in flight
    self._silent = False   # the session has ended: the thread prints nothing more

  def start(self, run: RunInfo) -> None:
    self._thread = threading.Thread(target=self._run, args=(run,), daemon=True,
                                    name=f"tracker-{self.name}")
    self._thread.start()

  def put(self, items: Sequence[tuple[Row, Optional[int]]]) -> None:
    with self._cond:
      self._queue.extend(items)
      self._cond.notify()

  def request_close(self, summary: Mapping[str, Any], failed: bool) -> None:
    with self._cond:
      self._closing = (summary, failed)
      self._cond.notify()

  def wait(self, deadline: float) -> bool:
    """Waits for the thread to end, until `deadline` (monotonic), or until a call has
    had no answer for `exit_wait_s`; not for a tracker that is down. Returns whether a
    call was left without an answer. Afterwards the thread prints nothing more."""
    while self._thread is not None and self._thread.is_alive() and not self.down:
      since = self.calling_since
      until = deadline if since is None else min(deadline, since + self.exit_wait_s)
      left_s = until - time.monotonic()
      if left_s <= 0:
        break
      self._thread.join(min(left_s, 0.1))
    with self._cond:
      self._silent = True
      since = self.calling_since
      return since is not None and time.monotonic() >= since + self.exit_wait_s

  def _say(self, message: str) -> None:
    with self._cond:
      if not self._silent:
        self._info(message)

  def unsent(self) -> int:
    """The rows the tracker has not confirmed: those queued, and those handed to a
    client that confirms at close and has not."""
    with self._cond:
      return len(self._fresh([*self._unconfirmed, *self._queue], self._progress))

  def _fresh(self, items: Sequence[tuple[Row, Optional[int]]],
             progress: Optional[dict[str, Any]] = None) -> list[Row]:
    """The rows of `items` past `progress` (what the tracker was handed unless given):
    the others are never offered again."""
    progress = self._handed if progress is None else progress
    with self._state.lock:
      sent = dict(progress["sent"])
      records = progress["records"]
    fresh = []
    for row, ordinal in items:
      if ordinal is None:
        if row.step > sent.get(row.kind, -1):
          fresh.append(row)
          sent[row.kind] = row.step
      elif ordinal >= records:
        fresh.append(row)
        records = ordinal + 1
    return fresh

  def _mark_sent(self, items: Sequence[tuple[Row, Optional[int]]],
                 progress: dict[str, Any]) -> None:
    with self._state.lock:
      sent = progress["sent"]
      for row, ordinal in items:
        if ordinal is None:
          sent[row.kind] = max(sent.get(row.kind, -1), row.step)
        else:
          progress["records"] = max(progress["records"], ordinal + 1)
      progress["unsent_rows"] = 0

  def _handed_over(self, items: Sequence[tuple[Row, Optional[int]]]) -> None:
    """Notes that the tracker took `items`: sent, or, for a client that confirms at
    close, handed over (`trackers.json` still lacks them)."""
    self._mark_sent(items, self._handed)
    if self._confirms_at_close:
      with self._cond:
        self._unconfirmed.extend(items)
    else:
      self._state.save()

  def _confirm(self) -> None:
    """The tracker's `close` returned: what it was handed has arrived."""
    with self._cond:
      confirmed, self._unconfirmed = self._unconfirmed, []
    if confirmed:
      self._mark_sent(confirmed, self._progress)
      self._state.save()

  def _next(self) -> Optional[list[tuple[Row, Optional[int]]]]:
    """Waits for rows to send (after the backoff, while down); None: time to stop."""
    with self._cond:
      while True:
        if self._closing is not None and (self.down or not self._queue):
          return None
        wait_s = self._retry_at - time.monotonic()
        if self._queue and (wait_s <= 0 or self._closing is not None):
          return list(self._queue)
        self._cond.wait(wait_s if self._queue else None)

  def _run(self, run: RunInfo) -> None:
    while (items := self._next()) is not None:
      self.calling_since = time.monotonic()
      try:
        if not self.opened:
          self._open(run)
        fresh = self._fresh(items)
        if fresh:
          self.tracker.log(fresh)
      except Exception as error:  # pylint: disable=broad-except
        self._failed(error)
        continue
      finally:
        self.calling_since = None
      self._handed_over(items)
      with self._cond:
        del self._queue[:len(items)]
      if self.down:
        self.down, self._backoff = False, FIRST_BACKOFF_S
        self._say(f"{self.name}: answers again; sent what it missed")
    if self.opened and not self.down:
      summary, failed = self._closing
      self.calling_since = time.monotonic()
      try:
        self.tracker.close(summary, failed)
        self._confirm()
      except Exception as error:  # pylint: disable=broad-except
        self._failed(error)
      finally:
        self.calling_since = None

  def _open(self, run: RunInfo) -> None:
    with self._state.lock:
      stored = self._progress["run_id"]
      last_step = max(self._progress["sent"].values(), default=0)
    run_id = self.tracker.open(run, stored, last_step if stored else 0)
    if run_id != stored:   # a new run (the first, or the stored one is gone): send it all
      with self._state.lock:
        self._progress.update(run_id=run_id, sent={}, records=0)
      self._state.save()
    if self._confirms_at_close:
      with self._state.lock:
        self._handed = {"sent": dict(self._progress["sent"]),
                        "records": self._progress["records"]}
    self.opened = True
    if self.tracker.where:
      self._say(f"{self.name}: {self.tracker.where}")

  def _failed(self, error: BaseException) -> None:
    with self._cond:
      if not self.warned and not self._silent:
        self.warned = True
        warn(f"{self.name} tracker: {_reason(error, self.service)}; the run goes on. "
             f"metrics.jsonl has every row; what {self.name} misses is sent when it "
             f"answers, by this run or the next in this workdir ({TRACKERS_STATE} "
             f"counts what it lacks){_client_log_note(self.workdir)}")
    self.down = True
    self._retry_at = time.monotonic() + self._backoff
    self._backoff = min(2 * self._backoff, MAX_BACKOFF_S)


class Trackers:
  """The trackers of one session (process 0): rows in, each tracker fed in order.

  Args:
    names: registered tracker names (`TrainConfig.trackers`).
    context: the workdir and its uploader, handed to each tracker's constructor.
    info: prints one line (the writer's console).
    exit_wait_s: the longest `close` waits for a call that has had no answer
      (`EXIT_WAIT_S` unless given).
  """

  def __init__(self, names: Sequence[str], context: TrackerContext,
               info: Callable[[str], None] = print, exit_wait_s: Optional[float] = None):
    self._state = _State(context.workdir, context.uploads) if names else None
    exit_wait_s = EXIT_WAIT_S if exit_wait_s is None else exit_wait_s
    self._senders = [_Sender(trackers_lib.create(name, context), self._state, info,
                             context.workdir, exit_wait_s) for name in names]
    self._run: Optional[RunInfo] = None
    self._records = 0
    self._finals = Finals()

  def start(self, run: RunInfo, written: Sequence[Mapping[str, Any]]) -> None:
    """Opens every tracker's run in its thread and offers it the rows already in
    `metrics.jsonl` (`written`): what it lacks of them is sent first."""
    if self._run is not None:
      return
    self._run = run
    if not self._senders:
      return
    items = []
    for record in written:
      items.append(self._item(rows_lib.from_json(record)))
    for sender in self._senders:
      sender.put(items)
      sender.start(run)

  def _item(self, row: Row) -> tuple[Row, Optional[int]]:
    self._finals.add(row)
    if row.kind in STEP_KINDS or row.kind in STEP_RECORD_KINDS:
      return row, None
    self._records += 1
    return row, self._records - 1

  @property
  def started(self) -> bool:
    return self._run is not None

  def log(self, row: Row) -> None:
    """Queues a row just written to `metrics.jsonl` (after `start`; before, the file
    holds it, and `start` offers it)."""
    if self._run is None or not self._senders:
      return
    item = self._item(row)
    for sender in self._senders:
      sender.put([item])

  def close(self, timeout_s: float, failed: bool = False) -> None:
    """Ends each tracker's session with the run's summary, waiting at most `timeout_s`
    for the trackers that answer, and at most `exit_wait_s` for a call that does not
    (not at all for a tracker that is down). What one still lacks is counted in
    `trackers.json`; one line says so when no warning has yet."""
    if self._run is None or not self._senders:
      return
    summary = self._finals.summary(self._run.facts)
    for sender in self._senders:
      sender.request_close(summary, failed)
    deadline = time.monotonic() + timeout_s
    for sender in self._senders:
      unanswered = sender.wait(deadline)
      unsent = sender.unsent()
      entry = self._state.entry(sender.name)
      with self._state.lock:
        entry["unsent_rows"] = unsent
      if sender.warned:
        continue
      if unanswered:
        warn(f"{sender.name} tracker: no answer from {sender.service} in "
             f"{sender.exit_wait_s:.0f} s at the end of the session; {unsent} row(s) not sent "
             f"(metrics.jsonl has them), which the next run in this workdir sends"
             f"{_client_log_note(sender.workdir)}")
      elif unsent:
        warn(f"{sender.name} tracker: {unsent} row(s) not sent before the session ended "
             f"(metrics.jsonl has them); the next run in this workdir sends them")
    self._state.save()
