"""Submits a command to a SLURM GPU cluster with `sbatch`, one process per GPU.

The library of `python -m launch.slurm` (launch/slurm.py, whose docstring is the
command's manual; its flags and main are there).

`SweepBackend` is `launch.sweep --backend=slurm`: a study's runs as one job array.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

from absl import flags

from launch.clusters import cluster_backend
from launch.clusters import common
from launch.dispatch import scheduler
from launch.dispatch import sweep_dispatch
from plumbing import storage
from plumbing.errors import UserError, usage_error


def _recovery_lines(max_restarts: int) -> list[str]:
  """Bash that saves and requeues the job on a preemption or time-limit signal, ends it
  on a cancel, and requeues it after a failed step, at most `max_restarts` times (SLURM
  counts requeues in SLURM_RESTART_COUNT).

  The trainer saves on SIGTERM, and it must get that signal itself: srun answers a
  SIGTERM by killing its tasks at once ("forcing job termination"), so the batch shell
  never signals srun. Who else gets a signal tells the three notices apart:
  * a preemption (its SIGTERM at the start of the grace time) or `scancel --signal=TERM
    JOB` reaches the tasks only; the shell does not see it. Each task saves the step all
    processes agree on and exits 0, and process 0 writes that step to
    $GRIFFIN_PREEMPTED_MARKER (pretrain.train), which tells this shell to requeue.
  * the time-limit warning (`--signal=B:USR1@S`, or `scancel --signal=USR1 --batch`)
    reaches only this shell, which forwards SIGTERM to every task of the job's steps
    (`scancel --signal=TERM $SLURM_JOB_ID`: steps only, not this shell or srun) and
    requeues once they have saved.
  * a cancel (`scancel JOB`, with or without `--full`) sends SIGTERM to this shell as
    well as to the tasks, and SIGKILL after KillWait: the tasks save if they can in that
    time, and the job ends as SLURM cancelled it, not requeued. SLURM ends a job the
    same way at its time limit, where slurmctld gives the reason `TimeLimit` and the
    shell requeues as after the warning, and at the end of a preemption's grace time
    or when a node of the job fails (slurmctld marks it DOWN), where SLURM has requeued
    the job itself (its restart count has grown).
  """
  return [
      f"max_restarts={max_restarts}",
      "restarts=${SLURM_RESTART_COUNT:-0}",
      'export GRIFFIN_PREEMPTED_MARKER="${TMPDIR:-/tmp}/griffin-preempted-$SLURM_JOB_ID"',
      'rm -f "$GRIFFIN_PREEMPTED_MARKER"',
      "requeue() {",
      '  if [ "$restarts" -lt "$max_restarts" ]; then',
      '    echo "launch.slurm: $1; requeueing job $SLURM_JOB_ID (restart $((restarts + 1)) '
      'of $max_restarts)" >&2',
      '    scontrol requeue "$SLURM_JOB_ID"',
      "    exit 0",
      "  fi",
      '  echo "launch.slurm: $1; the restart budget of $max_restarts is spent, so the job '
      'ends here (submit it again to resume from the newest checkpoint)" >&2',
      "  exit 1",
      "}",
      'signalled=""',
      'ended=""',
      'interrupted=""',
      "on_signal() {",
      '  echo "launch.slurm: received SIG$1; sending SIGTERM to the training tasks, which '
      'save their current step" >&2',
      '  signalled="SIG$1"',
      "  interrupted=1",
      '  scancel --signal=TERM "$SLURM_JOB_ID" || true',
      "}",
      "on_term() {",
      '  record=" $(scontrol show job --oneliner "$SLURM_JOB_ID" 2>/dev/null || true) "',
      '  case "$record" in',
      '    *" Reason=TimeLimit "*) signalled="SIGTERM at the time limit" ;;',
      '    *" Restarts=$restarts "*) ended="cancelled" ;;',
      '    *" Restarts="*) ended="requeued by SLURM (a preemption whose grace time ran '
      'out, or a node failed)" ;;',
      '    *) ended="cancelled" ;;',
      "  esac",
      "  interrupted=1",
      # No `return` in a trap: under `set -e` it would return the status of the `wait`
      # the signal interrupted (143) and end the shell.
      '  if [ -z "$ended" ]; then',
      '    echo "launch.slurm: received SIGTERM at the time limit; the training tasks save '
      'their current step" >&2',
      "  else",
      '    echo "launch.slurm: received SIGTERM: job $SLURM_JOB_ID was $ended; the training '
      'tasks save their current step if they can" >&2',
      # A cancel has signalled the tasks already (scancel then says the job is
      # completing); `scancel --signal=TERM --batch` reached this shell alone.
      '    scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || true',
      "  fi",
      "}",
      "trap 'on_signal USR1' USR1",
      "trap on_term TERM",
  ]


# squeue's states of a job that will not run again (a sweep's array is never requeued).
_ENDED_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
                           "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


def batch_script(command: Sequence[str], *, job_name: str, nodes: int, gpus_per_node: int,
                 cpus_per_task: int, time_limit: Optional[str], partition: Optional[str],
                 account: Optional[str], output: str, chdir: Optional[str], setup: str,
                 env: dict[str, str], array: Optional[str] = None, max_restarts: int = 0,
                 warning_s: int = 120) -> str:
  """The sbatch script text; `array` (e.g. "0-9") makes it a job array (launch.sweep).

  With `max_restarts` > 0 the job is requeueable: a failed training step or a preemption
  signal requeues it (at most `max_restarts` times in all), and with a `time_limit` SLURM
  sends SIGUSR1 `warning_s` seconds before the limit so the run saves and continues in
  the requeued job.
  """
  if nodes < 1 or gpus_per_node < 1:
    raise usage_error("--nodes and --gpus_per_node must be >= 1")
  if max_restarts < 0:
    raise usage_error("--max_restarts must be >= 0")
  directives = [
      f"--job-name={job_name}",
      f"--nodes={nodes}",
      f"--ntasks-per-node={gpus_per_node}",
      f"--gpus-per-node={gpus_per_node}",
      f"--cpus-per-task={cpus_per_task}",
      f"--output={output}",
      "--exclusive",
  ]
  for flag, value in (("--time", time_limit), ("--partition", partition),
                      ("--account", account), ("--chdir", chdir), ("--array", array)):
    if value:
      directives.append(f"{flag}={value}")
  if max_restarts:
    # --open-mode=append keeps the output of every attempt in one file.
    directives += ["--requeue", "--open-mode=append"]
    if time_limit:
      directives.append(f"--signal=B:USR1@{warning_s}")
  lines = ["#!/bin/bash"] + [f"#SBATCH {d}" for d in directives]
  lines += ["set -euo pipefail"]
  if setup:
    lines.append(setup)
  lines += [f"export {name}={common.shell_join([value])}" for name, value in env.items()]
  srun = "srun --kill-on-bad-exit=1 " + common.shell_join(command)
  if not max_restarts:
    lines.append(srun)
    return "\n".join(lines) + "\n"
  lines += _recovery_lines(max_restarts)
  # srun runs in the background so the traps run while it does. `wait` returns early
  # when a trapped signal arrives; the loop then waits on for srun's own exit status.
  lines += [
      f"{srun} &",
      "step=$!",
      "code=0",
      "while :; do",
      '  interrupted=""',
      '  wait "$step" && status=0 || status=$?',
      '  [ "$status" -eq 127 ] || code=$status',
      '  [ -n "$interrupted" ] || break',
      "done",
      'saved=$(cat "$GRIFFIN_PREEMPTED_MARKER" 2>/dev/null || echo "?")',
      'rm -f "$GRIFFIN_PREEMPTED_MARKER"',
      'if [ -n "$ended" ]; then',
      '  if [ "$saved" = "?" ]; then saved="no step (the step exited with code $code)"; '
      'else saved="step $saved"; fi',
      '  echo "launch.slurm: job $SLURM_JOB_ID was $ended; the run saved $saved; not '
      'requeueing it" >&2',
      "  exit 143",
      'elif [ "$code" -ne 0 ]; then',
      '  requeue "the training step exited with code $code"',
      'elif [ -n "$signalled" ] || [ "$saved" != "?" ]; then',
      '  requeue "preempted (${signalled:-SIGTERM to the tasks}); the run saved step $saved"',
      "fi",
  ]
  return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class SweepBackend(cluster_backend.ClusterBackend):
  """`launch.sweep --backend=slurm`: the study's runs as one sbatch job array, task i
  running job i, every task with the same resources (sweep_dispatch.Backend)."""
  nodes: int = 1
  gpus_per_node: int = 8
  cpus_per_task: int = 8
  time_limit: Optional[str] = None
  partition: Optional[str] = None
  account: Optional[str] = None

  name = "slurm"

  def define_flags(self) -> None:
    self.define_cluster_flags()
    flags.DEFINE_integer("nodes", self.nodes, "slurm: nodes per run.", lower_bound=1)
    flags.DEFINE_integer("gpus_per_node", self.gpus_per_node, "slurm: GPUs per node.",
                         lower_bound=1)
    flags.DEFINE_integer("cpus_per_task", self.cpus_per_task, "slurm: CPUs of each process.",
                         lower_bound=1)
    flags.DEFINE_string("time", self.time_limit, "slurm: wall-clock limit per run.")
    flags.DEFINE_string("partition", self.partition, "slurm: partition.")
    flags.DEFINE_string("account", self.account, "slurm: account.")

  def from_flags(self, values: flags.FlagValues) -> SweepBackend:
    return dataclasses.replace(
        self, **self.cluster_flags(values), nodes=values.nodes,
        gpus_per_node=values.gpus_per_node, cpus_per_task=values.cpus_per_task,
        time_limit=values.time,
        partition=values.partition, account=values.account)

  def submissions(self, jobs: Sequence[sweep_dispatch.Job], attempt: int,
                  study_dir: str) -> list[sweep_dispatch.Submission]:
    """One sbatch job array: task i runs job i (a `case` on SLURM_ARRAY_TASK_ID); its
    output goes to the study's `logs/` (to the submitting directory for a study in a
    bucket, which SLURM cannot write to)."""
    del attempt  # an array's job id keeps resubmissions apart
    logs = "." if storage.is_url(study_dir) else os.path.join(study_dir, "logs")
    cases = " ".join(f"{i}) exec {common.shell_join(job.wrapped())} ;;"
                     for i, job in enumerate(jobs))
    selector = f'case "$SLURM_ARRAY_TASK_ID" in {cases} *) exit 2 ;; esac'
    script = batch_script(
        ["bash", "-c", selector], job_name=self.job_name, nodes=self.nodes,
        gpus_per_node=self.gpus_per_node, cpus_per_task=self.cpus_per_task,
        time_limit=self.time_limit, partition=self.partition, account=self.account,
        output=os.path.join(logs, "slurm-%A_%a.out"), chdir=None,
        setup=self.setup, env=self.env, array=f"0-{len(jobs) - 1}")
    def job_ids(printed: str) -> dict[str, str]:   # `sbatch --parsable`: "ID[;cluster]"
      array_id = printed.strip().split(";")[0]
      print(f"Submitted batch job {array_id}", flush=True)
      return {job.run_dir: f"{array_id}_{i}" for i, job in enumerate(jobs)}
    return [sweep_dispatch.Submission(["sbatch", "--parsable"], script, script,
                                      directories=(logs,) if logs != "." else (),
                                      job_ids=job_ids)]

  def job_alive(self, job_id: str) -> bool:
    """Whether array task `job_id` ("ID_i") is queued or running (squeue); False once
    it has ended or SLURM has forgotten it. A squeue that fails otherwise ends the
    command with one line, its message and what to check (as one that does not answer:
    `scheduler.run`): when slurmctld is down squeue retries for 2 x (MessageTimeout - 1)
    s and says so on its captured stderr, and a sweep that read that as "cannot tell"
    kept every run `running` in silence, that wait once per run."""
    result = scheduler.run(["squeue", "--noheader", "--array", "--format=%i %T",
                            f"--jobs={job_id}"], stdout=True, stderr=True)
    if result.returncode != 0:
      if "Invalid job id" in result.stderr:
        return False
      said = (result.stderr.strip().splitlines() or ["no message"])[-1]
      raise UserError(f"squeue exited with code {result.returncode} ({said}): is "
                      f"slurmctld (scontrol ping) up? The sweep reads its runs' jobs "
                      f"from it")
    states = [line.split()[1] for line in result.stdout.splitlines()
              if line.split() and line.split()[0] == job_id]
    return any(state not in _ENDED_STATES for state in states)
