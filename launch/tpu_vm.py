"""Runs a command on every worker of a Cloud TPU VM slice over `gcloud ... ssh --worker=all`.

  python -m launch.tpu_vm --tpu=my-v5p-128 --zone=us-east5-a --tpu_type=v5p-128 \
      --setup='source ~/venv/bin/activate' --env=WANDB_MODE=offline -- \
      python -m pretrain.train --gin_file=configs/models/griffin_7b.gin \
      --gin_param='MeshConfig.fsdp=16' --gin_param='MeshConfig.tensor=4' \
      --workdir=gs://bucket/runs/griffin_7b

Every worker runs the same command; JAX finds its peers from the TPU VM's metadata
(`sharding.distributed.initialize_from_environment`), so no addresses are passed. The
repository must already be on every worker at `--remote_dir` (e.g. cloned by a startup
script). Each worker reruns the command after a failure, up to `--max_restarts` times,
and the trainer resumes from its newest checkpoint. `--dry_run` prints the exact gcloud
command instead of running it.

Preemption. On a maintenance event or a preemption the TPU VM shuts down, and the SIGTERM
must reach the trainer, which saves its step and exits 0 (pretrain/hooks.py). Without
retries the remote shell `exec`s the trainer, so the trainer is the process signalled.
With retries the loop's shell stays, traps SIGTERM, passes it to the trainer, waits for
it to save and exit, and then exits with the trainer's code instead of starting it
again (docs/contracts.md, "Preemption per launcher").
"""
from __future__ import annotations

import subprocess
import sys
from typing import Sequence

from absl import flags

from launch.clusters import common
from launch.clusters import tpu_vm
from plumbing import cli
from sharding.tpu_slice import TpuSlice


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Command-line flags, defined only when run as a program (see tests/test_entry_points)."""
  common.stop_flags_at_command()
  flags.DEFINE_string("tpu", None, "TPU VM (slice) name.")
  flags.DEFINE_string("zone", None, "The TPU VM's zone, e.g. us-east5-a.")
  flags.DEFINE_string("project", None, "Google Cloud project (default: gcloud's).")
  flags.DEFINE_string("tpu_type", None,
                      "e.g. v5p-128; only reported (workers, chips), never required.")
  flags.DEFINE_string("remote_dir", "griffin-pretrain",
                      "Repository checkout on each worker (relative to $HOME).")
  flags.DEFINE_integer("max_restarts", common.DEFAULT_MAX_RESTARTS,
                       "Each worker reruns the command after a failure at most this many "
                       "times (training resumes from its newest checkpoint).", lower_bound=0)
  flags.DEFINE_integer("retry_delay_s", 30, "Seconds between a failure and the rerun.",
                       lower_bound=0)
  common.define_cluster_flags(
      "Print the gcloud command instead of running it.",
      setup_help="Shell snippet run before the command, e.g. activating a venv.")
  flags.mark_flag_as_required("tpu")
  flags.mark_flag_as_required("zone")


def main(argv: Sequence[str]) -> None:
  command = common.child_command(argv)
  remote = tpu_vm.remote_command(command, FLAGS.remote_dir, FLAGS.setup,
                          common.parse_env_flags(FLAGS.env), FLAGS.max_restarts,
                          FLAGS.retry_delay_s)
  gcloud = tpu_vm.gcloud_argv(FLAGS.tpu, FLAGS.zone, FLAGS.project, remote)
  if FLAGS.tpu_type:
    tpu_slice = TpuSlice(FLAGS.tpu_type)
    print(f"# {tpu_slice.name}: {tpu_slice.hosts} workers x {tpu_slice.chips_per_host} chips "
          f"(topology {tpu_slice.topology}); one process per worker", flush=True)
  print(common.shell_join(gcloud), flush=True)
  if FLAGS.dry_run:
    return
  sys.exit(subprocess.run(gcloud, check=False).returncode)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
