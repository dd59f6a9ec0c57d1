"""Runs a command on every worker of a Cloud TPU VM slice over `gcloud ... ssh --worker=all`.

  python -m launch.tpu_vm --tpu=my-v5p-128 --zone=us-east5-a --tpu_type=v5p-128 \\
      --setup='source ~/venv/bin/activate' --env=WANDB_MODE=offline -- \\
      python -m pretrain.train --gin_file=configs/models/griffin_7b.gin \\
      --gin_param='MeshConfig.fsdp=16' --gin_param='MeshConfig.tensor=4' \\
      --workdir=gs://bucket/runs/griffin_7b

Every worker runs the same command; JAX finds its peers from the TPU VM's metadata
(`sharding.distributed.initialize_from_environment`), so no addresses are passed. The
repository must already be on every worker at `--remote_dir` (e.g. cloned by a startup
script). `--dry_run` prints the exact gcloud command instead of running it.
"""
from __future__ import annotations

from pretrain import quiet  # pylint: disable=unused-import  # first: see its docstring
import subprocess
import sys
from typing import Optional, Sequence

from absl import flags

from launch import common
from pretrain import cli


def remote_command(command: Sequence[str], remote_dir: str, setup: str,
                   env: dict[str, str]) -> str:
  """The shell line every worker runs."""
  steps = [f"cd {remote_dir}"]
  if setup:
    steps.append(setup)
  steps.append(common.env_prefix(env) + common.shell_join(command))
  return " && ".join(steps)


def gcloud_argv(tpu: str, zone: str, project: Optional[str], remote: str) -> list[str]:
  argv = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu, f"--zone={zone}"]
  if project:
    argv.append(f"--project={project}")
  return argv + ["--worker=all", f"--command={remote}"]


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
  common.define_cluster_flags(
      "Print the gcloud command instead of running it.",
      setup_help="Shell snippet run before the command, e.g. activating a venv.")
  flags.mark_flag_as_required("tpu")
  flags.mark_flag_as_required("zone")


def main(argv: Sequence[str]) -> None:
  command = common.child_command(argv)
  remote = remote_command(command, FLAGS.remote_dir, FLAGS.setup,
                          common.parse_env_flags(FLAGS.env))
  gcloud = gcloud_argv(FLAGS.tpu, FLAGS.zone, FLAGS.project, remote)
  if FLAGS.tpu_type:
    tpu_slice = common.TpuSlice(FLAGS.tpu_type)
    print(f"# {tpu_slice.name}: {tpu_slice.hosts} workers x {tpu_slice.chips_per_host} chips "
          f"(topology {tpu_slice.topology}); one process per worker", flush=True)
  print(common.shell_join(gcloud), flush=True)
  if FLAGS.dry_run:
    return
  sys.exit(subprocess.run(gcloud, check=False).returncode)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
