"""Submits a command to a SLURM GPU cluster with `sbatch`, one process per GPU.

  python -m launch.slurm --nodes=4 --gpus_per_node=8 --partition=gpu --time=24:00:00 \\
      --setup='source ~/griffin-pretrain/.venv/bin/activate' --dry_run -- \\
      python -m pretrain.train --gin_file=configs/models/griffin_1_3b.gin \\
      --gin_param='MeshConfig.fsdp=32' --workdir=/shared/runs/griffin_1_3b

`srun` starts nodes x gpus_per_node tasks; in each, JAX reads SLURM's variables (job id,
node list, task id, local id) to find the coordinator on the first node and to bind the
task to its GPU, so the command is the same as on one host. `--kill-on-bad-exit` ends
the whole step when any task fails. `--dry_run` prints the batch script and the sbatch
command instead of submitting.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

from launch import common


def batch_script(command: Sequence[str], *, job_name: str, nodes: int, gpus_per_node: int,
                 cpus_per_task: int, time_limit: Optional[str], partition: Optional[str],
                 account: Optional[str], output: str, chdir: Optional[str], setup: str,
                 env: dict[str, str]) -> str:
  """The sbatch script text."""
  if nodes < 1 or gpus_per_node < 1:
    raise SystemExit("--nodes and --gpus_per_node must be >= 1")
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
                      ("--account", account), ("--chdir", chdir)):
    if value:
      directives.append(f"{flag}={value}")
  lines = ["#!/bin/bash"] + [f"#SBATCH {d}" for d in directives]
  lines += ["set -euo pipefail"]
  if setup:
    lines.append(setup)
  lines += [f"export {name}={common.shell_join([value])}" for name, value in env.items()]
  lines.append("srun --kill-on-bad-exit=1 " + common.shell_join(command))
  return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m launch.slurm", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--nodes", type=int, required=True)
  parser.add_argument("--gpus_per_node", type=int, default=8)
  parser.add_argument("--cpus_per_task", type=int, default=8)
  parser.add_argument("--job_name", default="griffin-pretrain")
  parser.add_argument("--time", default=None, help="wall-clock limit, e.g. 24:00:00")
  parser.add_argument("--partition", default=None)
  parser.add_argument("--account", default=None)
  parser.add_argument("--output", default="slurm-%j.out")
  parser.add_argument("--chdir", default=None, help="working directory on the nodes")
  parser.add_argument("--setup", default="", help="shell line before srun, e.g. venv activation")
  parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
  parser.add_argument("--dry_run", action="store_true",
                      help="print the script and the sbatch command only")
  args, command = common.parse_launcher_args(parser, sys.argv[1:] if argv is None else argv)
  script = batch_script(
      command, job_name=args.job_name, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
      cpus_per_task=args.cpus_per_task, time_limit=args.time, partition=args.partition,
      account=args.account, output=args.output, chdir=args.chdir, setup=args.setup,
      env=common.parse_env_flags(args.env))
  if args.dry_run:
    sys.stdout.write(script)
    print("# submit with: sbatch <this script>")
    return 0
  with tempfile.NamedTemporaryFile("w", suffix=".sbatch", delete=False) as handle:
    handle.write(script)
  try:
    return subprocess.run(["sbatch", handle.name], check=False).returncode
  finally:
    os.unlink(handle.name)


if __name__ == "__main__":
  sys.exit(main())
