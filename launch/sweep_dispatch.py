"""Where a study's runs execute: this machine, N at a time, or a cluster through the
existing launchers' spec builders (one SLURM job array, one GKE JobSet per run, one TPU
queued resource per run).

A run's state is read from its directory, never from the dispatcher's memory, so that a
study can be stopped and resumed, or submitted twice, without redoing work:
  finished     its metrics hold the final evaluation (launch.sweep.final_eval);
  running      `sweep_status.json` (launch.sweep_job) says running, or submitted to a
               cluster; on this host a running status whose process is gone counts as
               interrupted instead;
  interrupted  stopped from outside (SIGTERM/SIGKILL, a preemption): resumed, free;
  failed       exited with an error `failures` times: retried while failures <=
               --max_retries;
  pending      never started.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from launch import common
from launch import gke
from launch import slurm
from launch import sweep_job
from launch import sweep_progress
from launch import tpu_vm

FINISHED, RUNNING, INTERRUPTED, FAILED, PENDING = (
    "finished", "running", "interrupted", "failed", "pending")
BACKENDS = ("local", "slurm", "gke", "tpu_vm")
_POLL_S = 0.2


@dataclasses.dataclass(frozen=True)
class Job:
  """One run to start: its name, directory and training command; `work` (its training
  FLOPs) weighs it in the local backend's ETA (launch.sweep_progress)."""
  name: str
  run_dir: str
  command: List[str]
  work: float = 1.0

  def wrapped(self, python: str = "python") -> List[str]:
    """The command inside launch.sweep_job, which records how it ends."""
    return [python, "-m", "launch.sweep_job", f"--run_dir={self.run_dir}", "--",
            *self.command]


def _process_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def run_state(run_dir: str, finished: bool) -> tuple[str, int]:
  """(state, failures so far) of the run in `run_dir` (module docstring)."""
  status = sweep_job.read_status(run_dir) or {}
  failures = int(status.get("failures", 0))
  if finished:
    return FINISHED, failures
  state = status.get("state")
  if state is None:
    return PENDING, failures
  if state == "submitted":
    return RUNNING, failures
  if state == "running":
    local = status.get("host") == socket.gethostname()
    if local and not _process_alive(int(status.get("pid", -1))):
      return INTERRUPTED, failures
    return RUNNING, failures
  if status.get("exit_code") in sweep_job.INTERRUPTED_CODES:
    return INTERRUPTED, failures
  return FAILED, failures


def running_here(run_dir: str) -> bool:
  """Whether the run is a live process on this host (e.g. left by a killed sweep)."""
  status = sweep_job.read_status(run_dir) or {}
  return (status.get("state") == "running" and status.get("host") == socket.gethostname()
          and _process_alive(int(status.get("pid", -1))))


def default_parallel() -> int:
  """Local runs at a time: one per 4 cores (each JAX process runs several threads)."""
  return max(1, (os.cpu_count() or 1) // 4)


def run_local(jobs: Sequence[Job], parallel: int, max_retries: int,
              is_finished: Callable[[Job], bool], log=print,
              progress: Optional[sweep_progress.Progress] = None,
              ready: Callable[[Job], bool] = lambda job: True) -> List[str]:
  """Runs `jobs` on this machine, at most `parallel` at once, retrying failures.

  Each job's output goes to `sweep_train.log` in its directory. SIGINT/SIGTERM are passed
  on to the running trainings (which checkpoint) before the sweep exits. `progress`
  (created here if None) writes the counts and ETA to stderr as runs start and end.
  A job starts only once `ready` says so (a cooldown fork: once its stable run has
  finished); jobs that can never become ready (what they wait for gave up) are given
  up too. Returns the names of the jobs that failed more than `max_retries` times, or
  were never ready.
  """
  if progress is None:
    progress = sweep_progress.Progress({job.name: job.work for job in jobs}, parallel)
  queue, running, given_up = list(jobs), {}, []
  unfinished_exits: Dict[str, int] = {}

  def stop(signum, _frame):
    for _, process in running.values():
      if process.poll() is None:
        os.killpg(process.pid, signum)
    for _, process in running.values():
      process.wait()
    raise SystemExit(128 + signum)
  previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    while queue or running:
      while len(running) < parallel:
        job = next((j for j in queue if ready(j)), None)
        if job is None:
          break
        queue.remove(job)
        os.makedirs(job.run_dir, exist_ok=True)
        log(f"[sweep] start {job.name}")
        with open(os.path.join(job.run_dir, "sweep_train.log"), "a",
                  encoding="utf-8") as out:
          running[job.name] = job, subprocess.Popen(job.wrapped(sys.executable), stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        progress.started(job.name)
      progress.tick()
      time.sleep(_POLL_S)
      for name, (job, process) in list(running.items()):
        if process.poll() is None:
          continue
        del running[name]
        state, failures = run_state(job.run_dir, is_finished(job))
        if state == FINISHED:
          log(f"[sweep] {job.name}: finished")
          progress.ended(job.name, "finished")
        elif state == FAILED and failures > max_retries:
          log(f"[sweep] {job.name}: failed {failures} times, giving up; see "
              f"{os.path.join(job.run_dir, 'sweep_train.log')}")
          given_up.append(job.name)
          progress.ended(job.name, "failed")
        elif state == INTERRUPTED and unfinished_exits.get(job.name, 0) >= max_retries:
          # Nobody stopped it, yet it ended without its final evaluation.
          log(f"[sweep] {job.name}: exited {process.returncode} without the final evaluation "
              "at its last step; does the data config have a validation split? See "
              f"{os.path.join(job.run_dir, 'sweep_train.log')}")
          given_up.append(job.name)
          progress.ended(job.name, "failed")
        else:
          if state == INTERRUPTED:
            unfinished_exits[job.name] = unfinished_exits.get(job.name, 0) + 1
          log(f"[sweep] {job.name}: {state} (exit code {process.returncode}, "
              f"{failures} failures), starting again")
          queue.append(job)
          progress.ended(job.name, "retry")
      if queue and not running and not any(ready(j) for j in queue):
        for job in queue:
          log(f"[sweep] {job.name}: what it starts from never finished; not started")
          given_up.append(job.name)
          progress.started(job.name)   # counted as failed, like a run given up
          progress.ended(job.name, "failed")
        queue.clear()
    progress.tick()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  return given_up


def dns_name(*parts: str, suffix: str = "") -> str:
  """A Kubernetes/GCE resource name: lower-case letters, digits and '-', <= 63 chars;
  `suffix` (an attempt number) is kept whole, so resubmissions never collide."""
  name = re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
  tail = f"-{suffix}" if suffix else ""
  return name[:63 - len(tail)].rstrip("-") + tail


@dataclasses.dataclass(frozen=True)
class ClusterOptions:
  """What every cluster job of the study runs on (flags of launch.sweep)."""
  job_name: str = "sweep"
  setup: str = ""
  env: Dict[str, str] = dataclasses.field(default_factory=dict)
  nodes: int = 1
  gpus_per_node: int = 8
  cpus_per_task: int = 8
  time_limit: Optional[str] = None
  partition: Optional[str] = None
  account: Optional[str] = None
  image: Optional[str] = None
  tpu_type: Optional[str] = None
  zone: Optional[str] = None
  project: Optional[str] = None
  runtime_version: str = "v2-alpha-tpuv5"
  remote_dir: str = "griffin-pretrain"


def slurm_array_script(jobs: Sequence[Job], options: ClusterOptions, output_dir: str) -> str:
  """One sbatch job array: task i runs job i (a `case` on SLURM_ARRAY_TASK_ID)."""
  cases = " ".join(f"{i}) exec {common.shell_join(job.wrapped())} ;;"
                   for i, job in enumerate(jobs))
  selector = f'case "$SLURM_ARRAY_TASK_ID" in {cases} *) exit 2 ;; esac'
  return slurm.batch_script(
      ["bash", "-c", selector], job_name=options.job_name, nodes=options.nodes,
      gpus_per_node=options.gpus_per_node, cpus_per_task=options.cpus_per_task,
      time_limit=options.time_limit, partition=options.partition, account=options.account,
      output=os.path.join(output_dir, "slurm-%A_%a.out"), chdir=None, setup=options.setup,
      env=options.env, array=f"0-{len(jobs) - 1}")


def gke_manifests(jobs: Sequence[Job], options: ClusterOptions, attempt: int) -> List[str]:
  """One JobSet manifest (YAML) per job."""
  tpu_slice = common.TpuSlice(options.tpu_type)
  return [common.to_yaml(gke.jobset_manifest(
      dns_name(options.job_name, job.name, suffix=f"a{attempt}"), options.image, job.wrapped(),
      tpu_slice, env=options.env)) for job in jobs]


def tpu_queued_resource_commands(jobs: Sequence[Job], options: ClusterOptions,
                                 attempt: int) -> List[List[str]]:
  """One `gcloud ... queued-resources create` per job; its startup script runs the job
  on every worker (tpu_vm.remote_command: cd, setup, env, command)."""
  commands = []
  for job in jobs:
    name = dns_name(options.job_name, job.name, suffix=f"a{attempt}")
    script = "#!/bin/bash\n" + tpu_vm.remote_command(job.wrapped(), options.remote_dir,
                                                     options.setup, options.env) + "\n"
    argv = ["gcloud", "compute", "tpus", "queued-resources", "create", name,
            f"--node-id={name}", f"--zone={options.zone}",
            f"--accelerator-type={options.tpu_type}",
            f"--runtime-version={options.runtime_version}"]
    if options.project:
      argv.append(f"--project={options.project}")
    commands.append(argv + [f"--metadata=startup-script={script}"])
  return commands


def submit_cluster(backend: str, jobs: Sequence[Job], options: ClusterOptions,
                   study_dir: str, dry_run: bool, log=print) -> None:
  """Prints (dry run) or submits the cluster jobs, marking each run `submitted`."""
  if not jobs:
    return
  attempt = int(time.time())
  if backend == "slurm":
    script = slurm_array_script(jobs, options, os.path.join(study_dir, "logs"))
    submissions = [(["sbatch"], script)]
    specs = [script]
  elif backend == "gke":
    manifests = gke_manifests(jobs, options, attempt)
    submissions = [(["kubectl", "apply", "-f", "-"], m) for m in manifests]
    specs = [m if i == 0 else "---\n" + m for i, m in enumerate(manifests)]
  else:
    commands = tpu_queued_resource_commands(jobs, options, attempt)
    submissions = [(argv, None) for argv in commands]
    specs = [common.shell_join(argv) + "\n" for argv in commands]
  if dry_run:
    sys.stdout.write("".join(specs))
    return
  for argv, text in submissions:
    code = subprocess.run(argv, input=text, text=True, check=False).returncode
    if code != 0:
      raise RuntimeError(f"{argv[0]} exited with code {code}")
  for job in jobs:
    sweep_job.write_status(job.run_dir, {
        "state": "submitted", "backend": backend,
        "failures": run_state(job.run_dir, False)[1]})
  log(f"[sweep] submitted {len(jobs)} run(s) to {backend}; run the same command again to "
      "see progress, resubmit failures and collect the results")
