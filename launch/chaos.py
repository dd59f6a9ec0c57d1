"""Fault injection: a multi-process training killed again and again must finish by itself
with the loss curve of an uninterrupted run.

  python -m launch.chaos --workdir=workdirs/chaos --steps=200 --faults=5 --seed=0

trains the same run twice with `launch.local` (2 processes x 2 CPU devices by default,
the quickstart model unless `--gin_file` says otherwise, every step logged):

  reference   uninterrupted (skipped when `--reference_workdir` already holds a finished
              run of the same steps);
  chaos       under `launch.local --max_restarts`, while this harness injects a fault
              of a seeded random kind (`--kinds`) into a random process at seeded random
              steps, `--faults` times:
                SIGKILL  the launcher stops the others and starts all again;
                SIGTERM  a preemption notice: every process saves the agreed step and
                         exits 0, and the harness (playing the scheduler) starts the
                         launcher again;
                corrupt  the newest checkpoint (of either tier) gets a data file torn
                         to half its size, then the process is killed: the restart
                         must skip that step for the previous good one;
                hang     the process is frozen (SIGSTOP), as by a dead file-system
                         mount: the other processes' watchdogs
                         (`TrainConfig.hang_timeout_s`, `--hang_timeout_s` here) see a
                         collective that never completes and exit, and the launcher
                         restarts every process.
              Two storage faults are drawn only when `--kinds` names them:
                disk_full  the local tier's disk fills up: this command mounts a tmpfs of
                         `--disk_mb` MiB at `<workdir>/local` before the run (it needs
                         root or CAP_SYS_ADMIN; where the mount is refused it stops with
                         one line saying so) and at the fault writes a filler that
                         leaves no byte free, removed after `--disk_full_s` seconds and
                         once the run has logged the step after its next local save (a
                         save met the full disk). The trainer turns that tier off with
                         one line and trains on: the run rides it out.
                outage   the bucket goes away: with `--gcs_emulator` the faulted run
                         trains into gs://bucket/chaos on a GCS emulator this command
                         starts (`launch.gcs_emulator`, a real server; objects under
                         `<workdir>/bucket`), reached by the trainers only through a TCP
                         proxy this command controls. The outage closes the proxy's
                         connections and refuses new ones for `--outage_fault_s`
                         seconds. Shorter than the run's `StorageConfig.outage_s`
                         (`--outage_s`), the run rides it out (saves deferred, training
                         goes on); longer, it saves its local tier and stops with one
                         line, and `launch.local` restarts it (restarts that find the
                         bucket still down end at once, with one line, and are retried
                         after a pause that doubles each time).
                         The rows of `metrics.jsonl` logged while the bucket was down by
                         a run that then stopped are kept beside its local tier and sent
                         by the restart, so every step is compared.

Each fault waits until the previous one has recovered (the new session logged a step;
for a storage fault ridden out, a step logged after the storage came back).
Then every step's logged loss is compared with the reference (relative difference at
most `--tolerance`), and a report is written to `<workdir>/chaos_report.json` and
`chaos_report.txt`: each fault (kind, process, step), the step resumed from and its
tier (or that it was ridden out), steps lost, time to recover (fault to the next logged
step: the trainers' own step times for a fault ridden out), the run's goodput
breakdown, and the verdict. Exit status 0 when the run finished with an equal loss
curve, 1 otherwise, 2 for a bad command line.
"""
from __future__ import annotations

import signal
import sys
from typing import Sequence

from absl import flags

from launch.faults import chaos
from plumbing import cli
from plumbing.errors import EXIT_FAILED


FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string("workdir", None, "Directory of the runs, logs and report.")
  flags.DEFINE_integer("steps", 200, "Training steps.", lower_bound=4)
  flags.DEFINE_integer("faults", 5, "Faults to inject.", lower_bound=1)
  flags.DEFINE_integer("seed", 0, "Seeds the fault steps, kinds and processes.")
  flags.DEFINE_integer("num_processes", 2, "Processes (simulated hosts).", lower_bound=1)
  flags.DEFINE_integer("devices_per_process", 2, "Simulated CPU devices per process.",
                       lower_bound=1)
  flags.DEFINE_multi_string("gin_file", ["configs/quickstart.gin"], "Training config.")
  flags.DEFINE_multi_string("gin_param", [], "Extra Gin bindings of both runs.")
  flags.DEFINE_integer("local_every", 10, "Local checkpoint tier interval of the faulted "
                       "run in steps; 0 turns the local tier off.", lower_bound=0)
  flags.DEFINE_integer("checkpoint_every", None, "Persistent checkpoint interval of both "
                       "runs (default: the config's CHECKPOINT_EVERY).", lower_bound=1)
  flags.DEFINE_float("tolerance", 1e-6, "Largest relative loss difference per step.")
  flags.DEFINE_string("reference_workdir", None, "The uninterrupted run (trained there "
                      "unless it already finished); default <workdir>/reference.")
  flags.DEFINE_float("timeout_s", 3600.0, "Give up after this many seconds.")
  flags.DEFINE_list("kinds", list(chaos.DEFAULT_KINDS), "Fault kinds to draw from: SIGKILL, "
                    "SIGTERM, corrupt (tear the newest checkpoint, then SIGKILL), hang "
                    "(SIGSTOP); and, not drawn unless named, disk_full (the local tier's "
                    "disk, a tmpfs of --disk_mb mounted by this command, filled for "
                    "--disk_full_s; needs root) and outage (the bucket cut off for "
                    "--outage_fault_s; needs --gcs_emulator).")
  flags.DEFINE_bool("gcs_emulator", False, "Train the faulted run into "
                    f"{chaos.BUCKET_WORKDIR} on a GCS emulator this command starts (objects "
                    "under <workdir>/bucket; the gcp-storage-emulator package), which the "
                    "trainers reach through a proxy that an outage cuts.")
  flags.DEFINE_float("outage_fault_s", 30.0, "How long an outage cuts the bucket off.",
                     lower_bound=0)
  flags.DEFINE_float("disk_full_s", 10.0, "How long a disk_full fills the disk at least "
                     "(it lasts until a local save has met it).", lower_bound=0)
  flags.DEFINE_float("outage_s", 60.0, "StorageConfig.outage_s of the faulted run with "
                     "--gcs_emulator: an outage shorter than this is ridden out, a longer "
                     "one stops the run after a local save and the launcher restarts it.",
                     lower_bound=0)
  flags.DEFINE_integer("disk_mb", 512, "Size in MiB of the tmpfs that holds the local "
                       "tier when disk_full is drawn: it must hold the local steps kept.",
                       lower_bound=1)
  flags.DEFINE_float("hang_timeout_s", 20.0, "TrainConfig.hang_timeout_s of the faulted "
                     "run: how long its watchdogs wait for a frozen peer.")
  flags.mark_flag_as_required("workdir")


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  # Stopped from outside: unwind, so the running launcher and its processes are stopped.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_FAILED))
  report = chaos.run_chaos(FLAGS.workdir, steps=FLAGS.steps, faults=FLAGS.faults,
                     seed=FLAGS.seed, processes=FLAGS.num_processes,
                     devices=FLAGS.devices_per_process, gin_files=FLAGS.gin_file,
                     gin_params=FLAGS.gin_param, local_every=FLAGS.local_every,
                     checkpoint_every=FLAGS.checkpoint_every, tolerance=FLAGS.tolerance,
                     reference_workdir=FLAGS.reference_workdir, timeout_s=FLAGS.timeout_s,
                     kinds=FLAGS.kinds, hang_timeout_s=FLAGS.hang_timeout_s,
                     gcs_emulator_bucket=FLAGS.gcs_emulator,
                     outage_fault_s=FLAGS.outage_fault_s, outage_s=FLAGS.outage_s,
                     disk_full_s=FLAGS.disk_full_s, disk_mb=FLAGS.disk_mb)
  print(report["text"], flush=True)
  if report["verdict"] != "pass":
    sys.exit(EXIT_FAILED)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
