"""Runs a study's runs through a backend: which runs to start, as what jobs, and what
became of them.

`execute` reads each run's state from its directory (`launch.dispatch.sweep_dispatch`),
turns the runs left to do into jobs (the run's training command,
`launch.sweeps.sweep_design`, inside `launch.sweep_job`) and hands them to the backend; `run_all` repeats that until
nothing is left to start. The built-in backends are registered here, in `--backend`'s
order. This is apart from `launch.dispatch.sweep_dispatch` because it needs the design
and the results, which the backend modules (importing `sweep_dispatch`) must not pull in.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Dict, Sequence

from launch.clusters import gke
from launch.clusters import slurm
from launch.clusters import tpu_vm
from launch.dispatch import sweep_dispatch
from launch.dispatch import sweep_job
from launch.sweeps import sweep_local
from launch.sweeps.sweep_design import Run, command, non_embedding_params
from launch.sweeps.sweep_results import collect, final_eval, write_results
from plumbing.errors import UserError

# The built-in backends; one defined elsewhere registers itself with
# `sweep_dispatch.register` before `launch.sweep.define_flags` runs (docs/INTERNALS.md).
for _backend in (sweep_local.LocalBackend(), slurm.SweepBackend(), gke.SweepBackend(),
                 tpu_vm.SweepBackend()):
  sweep_dispatch.register(_backend)
ORPHAN_POLL_S = 2.0


def execute(runs: Sequence[Run], gin_files: Sequence[str], gin_params: Sequence[str],
            backend: sweep_dispatch.Backend, *, max_retries: int = 1, study_dir: str = "",
            dry_run: bool = False, log: Callable[[str], None] = print) -> Dict[str, str]:
  """Starts every run that is not finished or running through `backend`; fills in the
  final evaluation of the finished ones (`collect`). Returns each run's state.

  A cooldown fork starts once its stable run has finished: locally as soon as it has,
  on a cluster at the next run of the command (a dry run prints those forks' specs
  after the others'). Runs the backend gives up on are written to `study_dir`'s
  results, then reported as a UserError."""
  todo, states, given_up_before = [], {}, 0
  by_name = {run.name: run for run in runs}

  def ready(job: sweep_dispatch.Job) -> bool:
    return job.after is None or final_eval(by_name[job.after]) is not None
  for run in runs:
    state, failures = sweep_dispatch.run_state(run.workdir, collect(run))
    states[run.name] = state
    if state == sweep_dispatch.FAILED and failures > max_retries:
      log(f"[sweep] {run.name}: failed {failures} times (more than --max_retries="
          f"{max_retries}); not retried; see {run.workdir}")
      given_up_before += 1
      continue
    if state in (sweep_dispatch.FINISHED, sweep_dispatch.RUNNING):
      detail = (f"eval loss {run.eval_loss:.4f}" if run.eval_loss is not None
                else "started elsewhere")
      log(f"[sweep] {run.name}: {state} ({detail}), skipped")
      continue
    if run.source is not None and states.get(run.source) == sweep_dispatch.RUNNING:
      # Its stable run trains outside this sweep (an earlier, killed one): looked at
      # again once that has ended.
      log(f"[sweep] {run.name}: waits for {run.source}, which is still running")
      continue
    why = (sweep_job.read_status(run.workdir) or {}).get("why")
    log(f"[sweep] {run.name}: {state}{f' ({why})' if why else ''}; "
        f"{non_embedding_params(run.config):,} non-embedding "
        f"params, {run.train_steps} steps, {run.tokens:,} tokens, {run.flops:.3g} FLOPs")
    # Here, this interpreter; on a cluster, the nodes' `python` (after --setup).
    python = sys.executable if backend.here else "python"
    todo.append(sweep_dispatch.Job(run.name, run.workdir,
                                   command(run, gin_files, gin_params, python), run.flops,
                                   after=run.source))
  study = sweep_dispatch.Study(
      study_dir, max_retries, dry_run, log, ready,
      lambda job: final_eval(by_name[job.name]) is not None,
      finished=sum(s == sweep_dispatch.FINISHED for s in states.values()),
      running=sum(s == sweep_dispatch.RUNNING for s in states.values()),
      failed=given_up_before)
  given_up = backend.dispatch(todo, study)
  if dry_run:
    return states
  for run in runs:
    states[run.name] = sweep_dispatch.run_state(run.workdir, collect(run))[0]
  if given_up:
    write_results(runs, study_dir, log=log)
    raise UserError(f"runs {given_up} failed more than --max_retries={max_retries} times; "
                    "their logs are sweep_train.log in their directories. Fix the cause "
                    "and run the same command again (finished runs are kept)")
  return states


def run_all(runs: Sequence[Run], gin_files: Sequence[str], gin_params: Sequence[str],
            backend: sweep_dispatch.Backend, *, max_retries: int, study_dir: str,
            dry_run: bool) -> Dict[str, str]:
  """`execute` until nothing is left to start; where runs execute here, those still
  training from an earlier (killed) sweep are waited for, then looked at again:
  finished, or resumed. `study_dir` gets the cluster logs and, if runs are given up,
  their partial results (the LR probes and the ladder keep theirs apart from the
  study's)."""
  while True:
    states = execute(runs, gin_files, gin_params, backend, max_retries=max_retries,
                     study_dir=study_dir, dry_run=dry_run,
                     log=(lambda _: None) if dry_run else print)
    if dry_run:
      return states
    orphans = [r.name for r in runs if backend.here
               and states[r.name] == sweep_dispatch.RUNNING
               and sweep_dispatch.running_here(r.workdir)]
    if not orphans:
      return states
    print(f"[sweep] waiting for {', '.join(orphans)}, still running from an earlier sweep")
    while any(sweep_dispatch.running_here(r.workdir) for r in runs if r.name in orphans):
      time.sleep(ORPHAN_POLL_S)
