"""Runs a command on every worker of a Cloud TPU VM slice over `gcloud ... ssh --worker=all`.

The library of `python -m launch.tpu_vm` (launch/tpu_vm.py, whose docstring is the
command's manual; its flags and main are there).

`SweepBackend` is `launch.sweep --backend=tpu_vm`: one queued resource per run, whose
startup script runs it on every worker.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from absl import flags

from launch.clusters import cluster_backend
from launch.clusters import common
from launch.dispatch import sweep_dispatch
from sharding.tpu_slice import TpuSlice


def remote_command(command: Sequence[str], remote_dir: str, setup: str,
                   env: dict[str, str], max_restarts: int = 0,
                   retry_delay_s: int = 30) -> str:
  """The shell line every worker runs.

  With `max_restarts` > 0 a worker whose command fails runs it again, at most that many
  times, `retry_delay_s` apart: when one worker dies the others' runtimes stop too (the
  coordinator's heartbeat), so all of them retry and meet again, and the trainer resumes
  from its newest checkpoint. Each attempt sees its number in GRIFFIN_RESTART_ATTEMPT.
  A SIGTERM to the worker's shell reaches the trainer: without restarts the shell execs
  it; with them the loop passes the signal on, waits for the save and exits with the
  trainer's code, never restarting it.
  """
  steps = [f"cd {remote_dir}"]
  if setup:
    steps.append(setup)
  run = common.env_prefix(env) + common.shell_join(command)
  if not max_restarts:
    # The trainer replaces the shell (assignments before `exec` reach its environment).
    return " && ".join(steps + [common.env_prefix(env) + "exec " + common.shell_join(command)])
  restart = f"{common.ENV_RESTART_ATTEMPT}=$attempt "
  loop = (
      # SIGTERM (a maintenance event, a preemption) goes to the trainer, which saves;
      # the loop then waits for it and ends with its exit code, never restarting it.
      "attempt=0; stop=; child=; "
      """trap 'stop=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM; """
      f"while true; do {restart}{run} & child=$!; "
      # A SIGTERM that came before `child` was set is passed on here.
      '[ -n "$stop" ] && kill -TERM "$child" 2>/dev/null; '
      # `wait` returns early when the trap runs; wait again until the trainer is gone.
      'wait "$child"; code=$?; '
      'while kill -0 "$child" 2>/dev/null; do wait "$child"; code=$?; done; child=; '
      'if [ -n "$stop" ]; then echo "launch.tpu_vm: SIGTERM passed to the command, which '
      'exited with code $code; not restarting" >&2; exit "$code"; fi; '
      '[ "$code" -eq 0 ] && exit 0; '
      f'if [ "$attempt" -ge {max_restarts} ]; then '
      'echo "launch.tpu_vm: the command exited with code $code; restart budget of '
      f'{max_restarts} spent" >&2; exit "$code"; fi; '
      "attempt=$((attempt + 1)); "
      'echo "launch.tpu_vm: the command exited with code $code; retry $attempt of '
      f'{max_restarts} in {retry_delay_s} s" >&2; '
      # An interruptible delay: the trap ends the sleep too (`child` is its PID).
      f'sleep {retry_delay_s} & child=$!; [ -n "$stop" ] || wait "$child"; '
      'kill "$child" 2>/dev/null; child=; '
      '[ -n "$stop" ] && { echo "launch.tpu_vm: SIGTERM during the retry delay; not '
      'restarting" >&2; exit 143; }; done')
  return " && ".join(steps) + " && { " + loop + "; }"


def gcloud_argv(tpu: str, zone: str, project: Optional[str], remote: str) -> list[str]:
  argv = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu, f"--zone={zone}"]
  if project:
    argv.append(f"--project={project}")
  return argv + ["--worker=all", f"--command={remote}"]


@dataclasses.dataclass(frozen=True)
class SweepBackend(cluster_backend.ClusterBackend):
  """`launch.sweep --backend=tpu_vm`: one `gcloud ... queued-resources create` per run,
  whose startup script runs it on every worker (`remote_command`: cd, setup, env,
  command) (sweep_dispatch.Backend)."""
  tpu_type: Optional[str] = None
  zone: Optional[str] = None
  project: Optional[str] = None
  runtime_version: str = "v2-alpha-tpuv5"
  remote_dir: str = "griffin-pretrain"

  name = "tpu_vm"

  def define_flags(self) -> None:
    self.define_cluster_flags(tpu=True)
    flags.DEFINE_string("zone", self.zone, "tpu_vm: zone of the queued resources.")
    flags.DEFINE_string("project", self.project, "tpu_vm: Google Cloud project.")
    flags.DEFINE_string("runtime_version", self.runtime_version, "tpu_vm: TPU VM software.")
    flags.DEFINE_string("remote_dir", self.remote_dir,
                        "tpu_vm: repository checkout on each worker.")

  def from_flags(self, values: flags.FlagValues) -> SweepBackend:
    sweep_dispatch.require_flags(values, self.name, ("tpu_type", "zone"))
    TpuSlice(values.tpu_type)  # a bad type is a usage error now, not at submission
    return dataclasses.replace(
        self, **self.cluster_flags(values), tpu_type=values.tpu_type, zone=values.zone,
        project=values.project, runtime_version=values.runtime_version,
        remote_dir=values.remote_dir)

  def submissions(self, jobs: Sequence[sweep_dispatch.Job], attempt: int,
                  study_dir: str) -> list[sweep_dispatch.Submission]:
    """One queued resource per job; a dry run prints each gcloud command."""
    del study_dir  # the workers keep their logs
    submissions = []
    for job in jobs:
      name = sweep_dispatch.dns_name(self.job_name, job.name, suffix=f"a{attempt}")
      script = "#!/bin/bash\n" + remote_command(job.wrapped(), self.remote_dir, self.setup,
                                                self.env) + "\n"
      argv = ["gcloud", "compute", "tpus", "queued-resources", "create", name,
              f"--node-id={name}", f"--zone={self.zone}",
              f"--accelerator-type={self.tpu_type}",
              f"--runtime-version={self.runtime_version}"]
      if self.project:
        argv.append(f"--project={self.project}")
      argv.append(f"--metadata=startup-script={script}")
      submissions.append(sweep_dispatch.Submission(argv, None,
                                                   common.shell_join(argv) + "\n"))
    return submissions
