"""Submits a command to a SLURM GPU cluster with `sbatch`, one process per GPU.

  python -m launch.slurm --nodes=4 --gpus_per_node=8 --partition=gpu --time=24:00:00 \
      --setup='source ~/griffin-pretrain/.venv/bin/activate' --dry_run -- \
      python -m pretrain.train --gin_file=configs/models/griffin_1_3b.gin \
      --gin_param='MeshConfig.fsdp=32' --workdir=/shared/runs/griffin_1_3b

`srun` starts nodes x gpus_per_node tasks; in each, JAX reads SLURM's variables (job id,
node list, task id, local id) to find the coordinator on the first node and to bind the
task to its GPU, so the command is the same as on one host. `--kill-on-bad-exit` ends
the whole step when any task fails. With `--max_restarts=N` (default 5) the job requeues
itself after a failed step or a preemption signal, and the trainer resumes from its
newest checkpoint. `--dry_run` prints the batch script and the sbatch command instead of
submitting.
"""
from __future__ import annotations

import sys
from typing import Sequence

from absl import flags

from launch.clusters import common
from launch.clusters import slurm
from launch.dispatch import scheduler
from plumbing import cli
from plumbing.errors import UserError


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Command-line flags, defined only when run as a program (see tests/test_entry_points)."""
  common.stop_flags_at_command()
  flags.DEFINE_integer("nodes", None, "Nodes to run on.", lower_bound=1)
  flags.DEFINE_integer("gpus_per_node", 8, "GPUs (and processes) per node.", lower_bound=1)
  flags.DEFINE_integer("cpus_per_task", 8, "CPUs of each process.", lower_bound=1)
  flags.DEFINE_string("job_name", "griffin-pretrain", "SLURM job name.")
  flags.DEFINE_string("time", None, "Wall-clock limit, e.g. 24:00:00.")
  flags.DEFINE_string("partition", None, "SLURM partition.")
  flags.DEFINE_string("account", None, "SLURM account.")
  flags.DEFINE_string("output", "slurm-%j.out", "The job's output file.")
  flags.DEFINE_string("chdir", None, "Working directory on the nodes.")
  flags.DEFINE_integer("max_restarts", common.DEFAULT_MAX_RESTARTS, "Requeue the job after a failure or preemption at "
                       "most this many times (0: never); training resumes from its newest "
                       "checkpoint.", lower_bound=0)
  flags.DEFINE_integer("warning_s", 120, "With --time and --max_restarts: seconds before the "
                       "limit at which SLURM signals the job to save and requeue.",
                       lower_bound=1)
  common.define_cluster_flags("Print the script and the sbatch command only.",
                              setup_help="Shell line before srun, e.g. venv activation.")
  flags.mark_flag_as_required("nodes")


def main(argv: Sequence[str]) -> None:
  command = common.child_command(argv)
  script = slurm.batch_script(
      command, job_name=FLAGS.job_name, nodes=FLAGS.nodes, gpus_per_node=FLAGS.gpus_per_node,
      cpus_per_task=FLAGS.cpus_per_task, time_limit=FLAGS.time, partition=FLAGS.partition,
      account=FLAGS.account, output=FLAGS.output, chdir=FLAGS.chdir, setup=FLAGS.setup,
      env=common.parse_env_flags(FLAGS.env), max_restarts=FLAGS.max_restarts,
      warning_s=FLAGS.warning_s)
  if FLAGS.dry_run:
    sys.stdout.write(script)
    print("# submit with: sbatch <this script>")
    return
  # The script goes in on stdin: no file that sbatch, run as the user, may not read.
  code = scheduler.run(["sbatch"], stdin=script).returncode
  if code != 0:   # a refusal (a wrong partition or account, no permission)
    raise UserError(f"sbatch exited with code {code} (its message is above)")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
