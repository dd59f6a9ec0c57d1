"""Fault injection: a multi-process training killed again and again must finish by itself

The library of `python -m launch.chaos` (launch/chaos.py, whose docstring is the
command's manual; its flags and main are there).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Iterator, Optional, Sequence

import fsspec.config

from launch.faults import gcs_emulator
from launch.faults.storage_faults import CuttableProxy, SmallDisk, start_gcs_emulator, stop_process

from plumbing import storage
from plumbing.errors import EXIT_FAILED, UserError, usage_error
from pretrain.observability import goodput
from pretrain.checkpoints.persistent import complete_steps
from pretrain.observability.metrics import format_duration
from pretrain.run_directory import RunDirectory
from sharding import distributed

_POLL_S = 0.05
_POLL_BUCKET_S = 0.5   # a bucket workdir's metrics are read through the emulator
_STACKS_S = 3.0        # for the stacks asked of a run that did not finish to reach the log
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "corrupt": signal.SIGKILL,
           "hang": signal.SIGSTOP}
STORAGE_KINDS = ("disk_full", "outage")   # no signal: the storage fails for a while
KINDS = tuple(SIGNALS) + STORAGE_KINDS
DEFAULT_KINDS = tuple(SIGNALS)            # the storage kinds need a mount or an emulator
BUCKET_WORKDIR = f"gs://{gcs_emulator.BUCKET}/chaos"


@dataclasses.dataclass
class Fault:
  """One injected fault and what followed it."""
  kind: str
  process: int
  planned_step: int
  at_step: Optional[int] = None       # newest logged step when the signal was sent
  sent_s: Optional[float] = None      # seconds since the chaos run started
  resumed_step: Optional[int] = None
  tier: Optional[str] = None
  steps_lost: Optional[int] = None
  recover_s: Optional[float] = None
  ended_s: Optional[float] = None     # a storage fault: when the storage was given back
  outcome: Optional[str] = None       # "restarted" or "rode it out" (training went on)


def plan_faults(steps: int, count: int, processes: int, seed: int,
                kinds: Sequence[str] = ("SIGKILL", "SIGTERM")) -> list[Fault]:
  """`count` faults at distinct random steps between 10% and 75% of the run (a
  preemption needs a few steps to be agreed on, and a fault must leave a restart to
  measure), kinds mixed (`kinds` in turn before shuffling), each at a random
  process."""
  unknown = sorted(set(kinds) - set(KINDS))
  if unknown or not kinds:
    raise usage_error(f"--kinds: unknown fault kind(s) {unknown}; choose from {KINDS}")
  if "hang" in kinds and processes < 2:
    raise usage_error("--kinds=hang needs --num_processes >= 2 (a frozen process is "
                      "noticed by the watchdogs of the others)")
  rng = random.Random(seed)
  low, high = max(2, steps // 10), max(3, steps * 3 // 4)
  if high - low < count:
    raise usage_error(f"--faults={count} do not fit in --steps={steps}; use more steps "
                      "or fewer faults")
  at = sorted(rng.sample(range(low, high), count))
  planned = [kinds[i % len(kinds)] for i in range(count)]
  rng.shuffle(planned)
  return [Fault(kind, rng.randrange(processes), step) for kind, step in zip(planned, at)]


def _tear_largest(directory: str) -> None:
  """Truncates the largest file under `directory` (local or in a bucket) to half."""
  files = storage.list_files(directory)
  if not files:
    return
  name, size = max(files.items(), key=lambda item: item[1])
  path = storage.join(directory, name)
  if storage.is_url(path):
    storage.write_bytes(path, storage.read_bytes(path)[:size // 2])
  else:
    os.truncate(path, size // 2)


def corrupt_newest_checkpoint(workdir: str, local_dir: Optional[str]) -> Optional[str]:
  """Truncates to half its size the largest array file of the newest complete step of
  either tier (every process's copy, for a local step), as a torn copy would; returns
  what it tore ("checkpoint 12", "local checkpoint 10"), None when there is no step.
  `workdir` may be a bucket URL (objects are rewritten at half their size)."""
  checkpoints = RunDirectory(workdir).checkpoints
  persistent = complete_steps(checkpoints)
  local = {}   # step -> its directories, one per process
  if local_dir and os.path.isdir(local_dir):
    for run in os.listdir(local_dir):
      if not os.path.isdir(os.path.join(local_dir, run)):
        continue   # e.g. the disk_full filler
      for process in os.listdir(os.path.join(local_dir, run)):
        root = os.path.join(local_dir, run, process)
        for step in complete_steps(root):
          local.setdefault(step, []).append(os.path.join(root, str(step), "shards"))
  newest_local = max(local, default=-1)
  if not persistent and newest_local < 0:
    return None
  if persistent and persistent[-1] >= newest_local:
    targets = [str(checkpoints / str(persistent[-1]) / "params")]
    name = f"checkpoint {persistent[-1]}"
  else:
    targets, name = local[newest_local], f"local checkpoint {newest_local}"
  for target in targets:
    try:
      _tear_largest(target)
    except (OSError, UserError):  # deleted meanwhile by the keep policy
      continue
  return name


def read_rows(workdir: str) -> list[dict]:
  """Complete rows of `workdir/metrics.jsonl` (a line being written is skipped); the
  workdir may be a bucket URL."""
  path = RunDirectory(workdir).metrics
  if not storage.is_url(path):
    if not os.path.exists(path):
      return []
    with open(path, encoding="utf-8") as f:
      return [json.loads(line) for line in f if line.endswith("\n")]
  try:
    text = storage.read_text(path) if storage.exists(path) else ""
  except UserError:   # replaced while being read: the next poll reads it
    return []
  return [json.loads(line) for line in text.splitlines(True) if line.endswith("\n")]


def train_rows(rows: Sequence[dict]) -> dict[int, float]:
  return {row["step"]: row["loss"] for row in rows if "loss" in row and "kind" not in row}


def compare_losses(reference: dict[int, float], run: dict[int, float],
                   tolerance: float) -> dict[str, Any]:
  """Every step of the reference must be in the run with a relative difference of at
  most `tolerance`."""
  missing = sorted(set(reference) - set(run))
  diffs = {step: abs(run[step] - loss) / max(abs(loss), 1e-12)
           for step, loss in reference.items() if step in run}
  worse = sorted(step for step, diff in diffs.items() if diff > tolerance)
  return {"steps_compared": len(diffs), "missing_steps": missing[:20],
          "max_rel_diff": max(diffs.values(), default=0.0), "mismatched_steps": worse[:20],
          "tolerance": tolerance, "equal": not missing and not worse and bool(diffs)}


def _children(launcher_pid: int) -> list[int]:
  """The launcher's running child processes (none once it has exited)."""
  try:
    with open(f"/proc/{launcher_pid}/task/{launcher_pid}/children", encoding="ascii") as f:
      return [int(pid) for pid in f.read().split()]
  except OSError:
    return []


def _child_pid(launcher_pid: int, process_id: int) -> Optional[int]:
  """The pid of the launcher's child running JAX process `process_id`, if running."""
  children = _children(launcher_pid)
  wanted = f"{distributed.ENV_PROCESS_ID}={process_id}".encode()
  for pid in children:
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        if wanted in f.read().split(b"\0"):
          return pid
    except OSError:
      continue
  return None


class StorageFaults:
  """Starts and ends the storage faults: the local tier's disk filled (`disk`), the
  bucket's proxy cut (`proxy`).

  An outage lasts `outage_fault_s`. A full disk lasts `disk_full_s` at least, and as it
  matters only to a save, until the run has also logged the step after its next local
  save (`local_every`), or restarted, or 4 x `disk_full_s` + 60 s passed: a full disk
  that no save met would measure nothing.
  """

  def __init__(self, outage_fault_s: float = 30.0, disk_full_s: float = 10.0,
               disk: Optional[SmallDisk] = None, proxy: Optional[CuttableProxy] = None,
               local_every: int = 0):
    self.durations = {"outage": outage_fault_s, "disk_full": disk_full_s}
    self.disk = disk
    self.proxy = proxy
    self.emulator: Optional[subprocess.Popen] = None   # the bucket's server, if any
    self._local_every = local_every

  def start(self, fault: Fault) -> str:
    """Makes the fault; returns what was done, for the log."""
    if fault.kind == "disk_full":
      size = self.disk.fill()
      return (f"filled the local tier's disk at {self.disk.directory} ({size / 2**20:.0f} "
              "MiB filler)")
    self.proxy.cut()
    return f"cut every connection to the bucket (proxy port {self.proxy.port})"

  def due(self, fault: Fault, now_s: float, logged: int, restarted: bool) -> bool:
    """Whether `fault`, started at `fault.sent_s`, should end at `now_s`."""
    elapsed, duration = now_s - fault.sent_s, self.durations[fault.kind]
    if elapsed < duration:
      return False
    if fault.kind != "disk_full" or restarted or elapsed > 4 * duration + 60:
      return True
    next_save = (fault.at_step // self._local_every + 1) * self._local_every
    return logged > next_save

  def end(self, fault: Fault) -> None:
    if fault.kind == "disk_full":
      self.disk.free()
    elif self.proxy.is_cut:
      self.proxy.restore()

  def end_all(self) -> None:
    """Gives the storage back whatever is under way (the run stopped early)."""
    if self.disk is not None:
      self.disk.free()
    if self.proxy is not None and self.proxy.is_cut:
      self.proxy.restore()


class ChaosRun:
  """Runs the faulted training and watches its metrics to time the faults."""

  def __init__(self, launcher: list[str], workdir: str, faults: list[Fault],
               max_relaunches: int, timeout_s: float, log_path: str,
               local_dir: Optional[str] = None, storage_faults: Optional[StorageFaults] = None,
               env: Optional[dict[str, str]] = None):
    self._launcher = launcher
    self._workdir = workdir
    self._local_dir = local_dir
    self._storage = storage_faults
    self._env = env
    self._poll_s = _POLL_BUCKET_S if storage.is_url(workdir) else _POLL_S
    self._faults = faults
    self._max_relaunches = max_relaunches
    self._timeout_s = timeout_s
    self._log_path = log_path
    self._started = 0.0
    self.relaunches = 0

  def _now(self) -> float:
    return time.monotonic() - self._started

  def _watch(self, process: subprocess.Popen, pending: list[Fault],
             recovering: list[Fault]) -> None:
    """Until the launcher exits: send due faults, note recoveries."""
    while process.poll() is None:
      if self._now() > self._timeout_s:
        _print_stacks(process, self._storage.emulator if self._storage else None)
        _stop_launcher(process)
        raise UserError(f"launch.chaos: the run did not finish within {self._timeout_s:.0f}"
                        f" s (see {self._log_path})", EXIT_FAILED)
      rows = read_rows(self._workdir)
      if recovering:
        fault = recovering[0]
        if fault.kind in STORAGE_KINDS and fault.ended_s is None:
          self._maybe_end(fault, rows)
        else:
          self._note_recovery(recovering, rows)
      elif pending:
        logged = max(train_rows(rows), default=0)
        fault = pending[0]
        if logged >= fault.planned_step and fault.kind in STORAGE_KINDS:
          what = self._storage.start(fault)
          fault.at_step, fault.sent_s = logged, self._now()
          print(f"launch.chaos: {fault.kind}: {what} at step {logged} "
                f"({format_duration(fault.sent_s)} into the run)", flush=True)
          recovering.append(pending.pop(0))
        elif logged >= fault.planned_step:
          pid = _child_pid(process.pid, fault.process)
          if pid is not None:
            torn = (corrupt_newest_checkpoint(self._workdir, self._local_dir)
                    if fault.kind == "corrupt" else None)
            os.kill(pid, SIGNALS[fault.kind])
            fault.at_step, fault.sent_s = logged, self._now()
            what = f" (tore {torn}, then SIGKILL)" if torn else ""
            print(f"launch.chaos: {fault.kind}{what} to process {fault.process} at step "
                  f"{logged} ({format_duration(fault.sent_s)} into the run)", flush=True)
            recovering.append(pending.pop(0))
      time.sleep(self._poll_s)

  def _wall(self, since_start_s: float) -> float:
    """The wall-clock time (as in metric rows) of a time since the run started."""
    return time.time() - (self._now() - since_start_s)

  def _restarted_since(self, rows: list[dict], wall: float) -> bool:
    return any(row.get("kind") == goodput.RESTART and row["time"] >= wall - 1.0
               for row in rows)

  def _maybe_end(self, fault: Fault, rows: list[dict]) -> None:
    """Gives the storage back once the fault has lasted long enough."""
    logged = max(train_rows(rows), default=0)
    restarted = self._restarted_since(rows, self._wall(fault.sent_s))
    if self._storage.due(fault, self._now(), logged, restarted):
      self._storage.end(fault)
      fault.ended_s = self._now()
      print(f"launch.chaos: {fault.kind} over after {fault.ended_s - fault.sent_s:.1f} s "
            f"(newest logged step {logged})", flush=True)

  def _note_recovery(self, recovering: list[Fault], rows: list[dict]) -> None:
    """A fault has recovered once a restart row newer than it is followed by a step."""
    fault = recovering[0]
    sent_at = time.time() - (self._now() - fault.sent_s)
    for i, row in enumerate(rows):
      if row.get("kind") == goodput.RESTART and row["time"] >= sent_at - 1.0:
        if any("loss" in later and "kind" not in later for later in rows[i + 1:]):
          fault.resumed_step, fault.tier = row["step"], row["tier"]
          fault.steps_lost = max(0, fault.at_step - row["step"])
          fault.recover_s = self._now() - fault.sent_s
          origin = (f"the {fault.tier} checkpoint of step {fault.resumed_step}"
                    if fault.tier else "scratch (no checkpoint yet)")
          print(f"launch.chaos: resumed from {origin} ({fault.steps_lost} steps lost), "
                f"training again {fault.recover_s:.1f} s after the {fault.kind}", flush=True)
          fault.outcome = "restarted"
          recovering.pop(0)
        return
    if fault.kind in STORAGE_KINDS:
      self._note_ridden_out(recovering, rows, sent_at)

  def _note_ridden_out(self, recovering: list[Fault], rows: list[dict],
                       sent_at: float) -> None:
    """A storage fault that ended with no restart, once a step was logged after it
    ended, was ridden out: no step lost; recovery is the fault's start to the first
    step logged after it (the run's own times: rows logged while a bucket was down
    reach it later). A step's time is that of its goodput row (step rows have none)."""
    fault = recovering[0]
    times = [row["time"] for row in rows if row.get("kind") == goodput.GOODPUT]
    if not any(t >= self._wall(fault.ended_s) for t in times):
      return
    fault.steps_lost, fault.outcome = 0, "rode it out"
    fault.recover_s = min(t for t in times if t >= sent_at) - sent_at
    print(f"launch.chaos: the run rode out the {fault.kind} (no restart, no step lost); "
          f"next step {fault.recover_s:.1f} s after it began", flush=True)
    recovering.pop(0)

  def run(self, finished) -> None:
    """Launches until `finished()`; relaunches after a preemption's clean exit."""
    self._started = time.monotonic()
    pending, recovering = list(self._faults), []
    with open(self._log_path, "a", encoding="utf-8") as log:
      while True:
        process = subprocess.Popen(self._launcher, stdout=log, stderr=subprocess.STDOUT,
                                   env=self._env)
        try:
          self._watch(process, pending, recovering)
        finally:
          _stop_launcher(process)
          if self._storage is not None:
            self._storage.end_all()
        if process.returncode != 0:
          raise UserError(f"launch.chaos: launch.local gave up with exit code "
                          f"{process.returncode} (see {self._log_path})", EXIT_FAILED)
        if finished():
          return
        if self.relaunches >= self._max_relaunches:
          raise UserError(f"launch.chaos: the run stopped unfinished "
                          f"{self.relaunches + 1} times (see {self._log_path})", EXIT_FAILED)
        self.relaunches += 1
        print("launch.chaos: every process exited after a preemption; starting the "
              "launcher again", flush=True)


def _print_stacks(process: subprocess.Popen, emulator: Optional[subprocess.Popen]) -> None:
  """Asks the launcher and its trainers to print every thread's stack into the log
  (SIGUSR2, see `plumbing.cli`), and the GCS emulator into its own: what a run that did
  not finish was waiting for."""
  servers = [emulator.pid] if emulator is not None else []
  for pid in [process.pid, *_children(process.pid), *servers]:
    with contextlib.suppress(ProcessLookupError):
      os.kill(pid, signal.SIGUSR2)
  time.sleep(_STACKS_S)


def _stop_launcher(process: subprocess.Popen) -> None:
  """SIGTERM to the launcher, which stops its processes; SIGKILL if it lingers."""
  stop_process(process, signal.SIGTERM, timeout_s=30)


def training_command(workdir: str, steps: int, gin_files: Sequence[str],
                     gin_params: Sequence[str]) -> list[str]:
  """The trainer's command: every step logged, no evaluation or sample (they do not
  touch the training state, and only cost time here)."""
  params = [f"TRAIN_STEPS={steps}", "LOG_EVERY=1", "EVAL_EVERY=0",
            "TrainConfig.final_eval=False", "TrainConfig.sample_prompt=None", *gin_params]
  return ([sys.executable, "-m", "pretrain.train"] +
          [f"--gin_file={f}" for f in gin_files] +
          [f"--gin_param={p}" for p in params] + [f"--workdir={workdir}"])


def launcher_command(command: Sequence[str], processes: int, devices: int,
                     max_restarts: int) -> list[str]:
  return [sys.executable, "-m", "launch.local", f"--num_processes={processes}",
          f"--devices_per_process={devices}", f"--max_restarts={max_restarts}", "--",
          *command]


def _finished(workdir: str, steps: int) -> bool:
  return steps in complete_steps(RunDirectory(workdir).checkpoints)


def format_report(report: dict[str, Any]) -> str:
  """The text form of the report."""
  lines = [f"chaos run: {report['processes']} processes x {report['devices_per_process']}"
           f" devices, {report['steps']} steps, {len(report['faults'])} faults "
           f"(seed {report['seed']}), local tier "
           f"{'every %d steps' % report['local_every'] if report['local_every'] else 'off'}"
           f", persistent every {report['checkpoint_every'] or 'config'} steps",
           "fault  kind       process  at step  resumed from        lost  recover"]
  for i, f in enumerate(report["faults"], 1):
    if f.get("outcome") == "rode it out":
      resumed = "- (rode it out)"
    else:
      resumed = ("-" if f["resumed_step"] is None else
                 f"{f['resumed_step']} ({f['tier'] or 'scratch'})")
    process = "-" if f["kind"] in STORAGE_KINDS else f["process"]
    recover = f"{f['recover_s']:.1f} s" if f["recover_s"] is not None else "-"
    lines.append(f"{i:>5}  {f['kind']:<9}  {process:>7}  {str(f['at_step']):>7}  "
                 f"{resumed:<18}  {str(f['steps_lost']):>4}  {recover}")
  loss = report["loss_check"]
  lines.append(f"loss curve: {loss['steps_compared']} steps compared with the "
               f"uninterrupted run, max relative difference {loss['max_rel_diff']:.2e} "
               f"({'equal' if loss['equal'] else 'DIFFERENT'} within {loss['tolerance']})")
  if report["goodput"]:
    lines.append(goodput.format_totals(report["goodput"]))
  if report["median_recover_s"] is not None:
    lines.append(f"steps lost {report['steps_lost']}, median time to recover "
                 f"{report['median_recover_s']:.1f} s, wall {format_duration(report['wall_s'])}"
                 f", launcher relaunches after preemption {report['relaunches']}")
  lines.append(f"verdict: {report['verdict']}")
  return "\n".join(lines)


def restart_budget(plan: Sequence[Fault], outage_fault_s: float) -> int:
  """`launch.local --max_restarts` of the faulted run: one restart per fault, 2 to
  spare, and for each outage enough restarts for the launcher's pauses to outlast it. A
  run stopped by an outage is restarted, and a restart while the bucket is still down
  ends in seconds (its first check of the workdir fails with one line); `launch.local`
  pauses 1 s before the first restart and doubles the pause (at most 60 s) while attempts
  keep failing at once."""
  outages = sum(f.kind == "outage" for f in plan)
  pauses, waited_s = 0, 0.0
  while waited_s < outage_fault_s:
    waited_s += min(60.0, 2.0 ** pauses)
    pauses += 1
  return len(plan) + 2 + outages * pauses


def train_reference(reference_dir: str, workdir: str, command: list[str],
                    steps: int) -> None:
  """Trains the uninterrupted run unless `reference_dir` holds it finished already."""
  if _finished(reference_dir, steps):
    return
  print(f"launch.chaos: training the uninterrupted reference in {reference_dir}",
        flush=True)
  with open(os.path.join(workdir, "reference.log"), "a", encoding="utf-8") as log:
    code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
  if code != 0 or not _finished(reference_dir, steps):
    raise UserError(f"launch.chaos: the reference run failed (exit {code}; see "
                    f"{workdir}/reference.log)", EXIT_FAILED)


def check_storage_kinds(kinds: Sequence[str], local_every: int, bucket: bool) -> None:
  """The storage kinds need what they fault: a local tier to fill, a bucket to cut."""
  if "disk_full" in kinds and not local_every:
    raise usage_error("--kinds=disk_full fills the disk of the local checkpoint tier: "
                      "it needs --local_every > 0")
  if "outage" in kinds and not bucket:
    raise usage_error("--kinds=outage cuts the run off its bucket: pass --gcs_emulator "
                      f"(the faulted run then trains into {BUCKET_WORKDIR} on a local GCS "
                      "emulator, through a proxy that the outage cuts)")


@contextlib.contextmanager
def _clients_pointed_at(endpoint: str) -> Iterator[None]:
  """For the block, this process's storage clients (gcsfs, reading the run's metrics
  and checkpoints) talk to `endpoint`; fsspec read its FSSPEC_* variables at import, so
  its config is set too, and gcsfs's cached file systems (each bound to an endpoint)
  are dropped. Everything is put back after (a caller's own bucket, if any)."""
  variables = gcs_emulator.environment(endpoint)
  saved_env = {name: os.environ.get(name) for name in variables}
  saved_conf = {p: dict(fsspec.config.conf.get(p, {})) for p in ("gs", "gcs")}
  os.environ.update(variables)
  # Imported after the variables are set: gcsfs picks its file system class at import,
  # and with GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT unset that one first probes the real
  # service over gRPC (minutes of retries per call here; seen under pytest).
  gcs = fsspec.get_filesystem_class("gs")
  for protocol in saved_conf:
    fsspec.config.conf.setdefault(protocol, {})["token"] = "anon"
  gcs.clear_instance_cache()
  try:
    yield
  finally:
    for name, value in saved_env.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value
    fsspec.config.conf.update(saved_conf)
    gcs.clear_instance_cache()


@contextlib.contextmanager
def faulted_storage(workdir: str, plan: Sequence[Fault], local_dir: Optional[str],
                    bucket: bool, disk_mb: int, faults: StorageFaults
                    ) -> Iterator[tuple[str, Optional[dict[str, str]], StorageFaults]]:
  """The faulted run's storage, for the block: yields its workdir, the launcher's
  environment (None: this process's) and `faults`, given the disk and proxy to fault.

  With `bucket`, a GCS emulator (objects under `workdir/bucket`) and a proxy in front of
  it: the trainers reach the bucket only through the proxy, this process directly. With
  a disk_full in the plan, a `disk_mb` MiB tmpfs at the local tier's directory, mounted
  from the start (the run's local checkpoints live on it throughout)."""
  disk = (SmallDisk(local_dir, disk_mb)
          if local_dir and any(f.kind == "disk_full" for f in plan) else None)
  emulator = proxy = None
  try:
    with contextlib.ExitStack() as stack:
      if disk is not None:
        disk.mount()
      chaos_dir, env = os.path.join(workdir, "chaos"), None
      if bucket:
        os.makedirs(os.path.join(workdir, "bucket"))
        emulator, port = start_gcs_emulator(os.path.join(workdir, "bucket"),
                                            log_path=os.path.join(workdir, "gcs_emulator.log"))
        proxy = CuttableProxy(port)
        env = dict(os.environ, **gcs_emulator.environment(proxy.endpoint))
        stack.enter_context(_clients_pointed_at(f"http://127.0.0.1:{port}"))
        chaos_dir = BUCKET_WORKDIR
      faults.disk, faults.proxy, faults.emulator = disk, proxy, emulator
      yield chaos_dir, env, faults
  finally:
    if proxy is not None:
      proxy.close()
    if emulator is not None:
      stop_process(emulator)
    if disk is not None:
      disk.unmount()


def run_chaos(workdir: str, *, steps: int, faults: int, seed: int, processes: int,
              devices: int, gin_files: Sequence[str], gin_params: Sequence[str],
              local_every: int, checkpoint_every: Optional[int], tolerance: float,
              reference_workdir: Optional[str], timeout_s: float,
              kinds: Sequence[str] = ("SIGKILL", "SIGTERM"),
              hang_timeout_s: float = 20.0, gcs_emulator_bucket: bool = False,
              outage_fault_s: float = 30.0, outage_s: float = 60.0,
              disk_full_s: float = 10.0, disk_mb: int = 512) -> dict[str, Any]:
  """Trains the reference and the faulted run; returns the report (also written)."""
  workdir = os.path.abspath(workdir)
  for used in ("chaos", "bucket"):
    if os.path.exists(os.path.join(workdir, used)):
      raise usage_error(f"{os.path.join(workdir, used)} exists (a previous chaos run); "
                        "pass a new --workdir")
  check_storage_kinds(kinds, local_every, gcs_emulator_bucket)
  os.makedirs(workdir, exist_ok=True)
  reference_dir = os.path.abspath(reference_workdir or os.path.join(workdir, "reference"))
  params = list(gin_params)
  if checkpoint_every:
    params.append(f"CHECKPOINT_EVERY={checkpoint_every}")
  plan = plan_faults(steps, faults, processes, seed, kinds)

  chaos_params = list(params) + [f"TrainConfig.hang_timeout_s={hang_timeout_s}"]
  local_dir = os.path.join(workdir, "local") if local_every else None
  if local_every:
    chaos_params += [f"CheckpointConfig.local_dir='{local_dir}'",
                     f"CheckpointConfig.local_every={local_every}"]
  if gcs_emulator_bucket:
    chaos_params.append(f"StorageConfig.outage_s={outage_s}")
  faults_made = StorageFaults(outage_fault_s, disk_full_s, local_every=local_every)
  # The storage first: a refused mount is said before the reference's minutes of training.
  with faulted_storage(workdir, plan, local_dir, gcs_emulator_bucket, disk_mb,
                       faults_made) as (chaos_dir, env, storage_faults):
    train_reference(reference_dir, workdir, launcher_command(
        training_command(reference_dir, steps, gin_files, params), processes, devices, 0),
                    steps)
    print(f"launch.chaos: training under {faults} faults in {chaos_dir}", flush=True)
    started = time.monotonic()
    run = ChaosRun(
        launcher_command(training_command(chaos_dir, steps, gin_files, chaos_params),
                         processes, devices, max_restarts=restart_budget(plan, outage_fault_s)),
        chaos_dir, plan, max_relaunches=faults + 2, timeout_s=timeout_s,
        log_path=os.path.join(workdir, "chaos.log"), local_dir=local_dir,
        storage_faults=storage_faults, env=env)
    run.run(lambda: _finished(chaos_dir, steps))
    wall = time.monotonic() - started
    rows = read_rows(chaos_dir)
  loss = compare_losses(train_rows(read_rows(reference_dir)), train_rows(rows), tolerance)
  recovered = [f.recover_s for f in plan if f.recover_s is not None]
  # A fault sent so late that the run finished without a restart is reported, not failed.
  unanswered = [f for f in plan if f.sent_s is not None and f.recover_s is None]
  all_injected = all(f.sent_s is not None for f in plan)
  report = {
      "steps": steps, "processes": processes, "devices_per_process": devices,
      "seed": seed, "local_every": local_every, "checkpoint_every": checkpoint_every,
      "kinds": list(kinds), "hang_timeout_s": hang_timeout_s,
      "workdir": chaos_dir, "outage_fault_s": outage_fault_s, "disk_full_s": disk_full_s,
      "outage_s": outage_s if gcs_emulator_bucket else None,
      "gin_files": list(gin_files), "gin_params": list(gin_params),
      "faults": [dataclasses.asdict(f) for f in plan],
      "steps_lost": sum(f.steps_lost or 0 for f in plan),
      "median_recover_s": statistics.median(recovered) if recovered else None,
      "relaunches": run.relaunches, "wall_s": wall,
      "restarts": [row for row in rows if row.get("kind") == goodput.RESTART],
      "loss_check": loss, "goodput": goodput.run_totals(rows),
      "reference_goodput": goodput.run_totals(read_rows(reference_dir)),
      "verdict": "pass" if loss["equal"] and all_injected else "fail",
  }
  with open(os.path.join(workdir, "chaos_report.json"), "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  text = format_report(report)
  if not all_injected:
    text += "\n(not every planned fault was injected before the run ended)"
  elif unanswered:
    text += (f"\n({len(unanswered)} fault(s) came so late that the run finished without a "
             "restart)")
  with open(os.path.join(workdir, "chaos_report.txt"), "w", encoding="utf-8") as f:
    f.write(text + "\n")
  return report | {"text": text}
