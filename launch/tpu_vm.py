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

import argparse
import subprocess
import sys
from typing import Optional, Sequence

from launch import common


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


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m launch.tpu_vm", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tpu", required=True, help="TPU VM (slice) name")
  parser.add_argument("--zone", required=True)
  parser.add_argument("--project", default=None)
  parser.add_argument("--tpu_type", default=None,
                      help="e.g. v5p-128; only reported (workers, chips), never required")
  parser.add_argument("--remote_dir", default="griffin-pretrain",
                      help="repository checkout on each worker (relative to $HOME)")
  parser.add_argument("--setup", default="",
                      help="shell snippet run before the command, e.g. activating a venv")
  parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                      help="environment variable for the command (repeatable)")
  parser.add_argument("--dry_run", action="store_true",
                      help="print the gcloud command instead of running it")
  args, command = common.parse_launcher_args(parser, sys.argv[1:] if argv is None else argv)
  remote = remote_command(command, args.remote_dir, args.setup,
                          common.parse_env_flags(args.env))
  gcloud = gcloud_argv(args.tpu, args.zone, args.project, remote)
  if args.tpu_type:
    tpu_slice = common.TpuSlice(args.tpu_type)
    print(f"# {tpu_slice.name}: {tpu_slice.hosts} workers x {tpu_slice.chips_per_host} chips "
          f"(topology {tpu_slice.topology}); one process per worker", flush=True)
  print(common.shell_join(gcloud), flush=True)
  if args.dry_run:
    return 0
  return subprocess.run(gcloud, check=False).returncode


if __name__ == "__main__":
  sys.exit(main())
