"""Runs a command on one or more TPU slices of a GKE cluster as a JobSet.

  python -m launch.gke --name=griffin-7b --image=us-docker.pkg.dev/P/repo/griffin:latest \
      --tpu_type=v5p-128 --num_slices=2 --dry_run -- \
      python -m pretrain.train --gin_file=configs/models/griffin_7b.gin \
      --gin_param='MeshConfig.replica=2' --gin_param='MeshConfig.fsdp=16' \
      --gin_param='MeshConfig.tensor=4' --workdir=gs://bucket/runs/griffin_7b

The JobSet has one replicated job whose replicas are the slices; each slice is an
Indexed Job with one pod per TPU VM host (completions = parallelism = hosts per slice),
pinned to the slice's node pool by the accelerator and topology node selectors. GKE's
TPU webhook gives each pod TPU_WORKER_ID and TPU_WORKER_HOSTNAMES, from which JAX finds
its peers; for several slices the manifest also sets the MEGASCALE_* variables that
join the slices over DCN (the `replica` mesh axis). `--dry_run` prints the manifest;
otherwise it is piped to `kubectl apply -f -`.

Preemption. The container's command is the trainer itself (no shell around it), so the
SIGTERM that Kubernetes sends on a preemption, a node maintenance event or a JobSet
restart reaches the process that saves (pretrain/hooks.py PreemptionHook). The pods'
`terminationGracePeriodSeconds` (how long Kubernetes waits after SIGTERM before SIGKILL)
is derived from the checkpoint each host writes (`termination_grace_s`, the rule in
docs/contracts.md "Preemption per launcher") and printed by `--dry_run`.
"""
from __future__ import annotations

import sys
from typing import Sequence

from absl import flags

from launch.clusters import common
from launch.clusters import gke
from launch.dispatch import scheduler
from plumbing import cli
from plumbing.errors import UserError
from sharding.tpu_slice import TpuSlice


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Command-line flags, defined only when run as a program (see tests/test_entry_points)."""
  common.stop_flags_at_command()
  flags.DEFINE_string("name", None, "JobSet name (DNS label).")
  flags.DEFINE_string("image", None, "Container image with this repository.")
  flags.DEFINE_string("tpu_type", None, "Slice type, e.g. v5p-128.")
  flags.DEFINE_string("topology", None, "Override of the slice's topology, e.g. 4x4x4.")
  flags.DEFINE_integer("num_slices", 1, "Slices (JobSet replicas), joined over DCN.",
                       lower_bound=1)
  flags.DEFINE_integer("max_restarts", common.DEFAULT_MAX_RESTARTS,
                       "JobSet restarts after a failure or preemption (training resumes "
                       "from the latest checkpoint).", lower_bound=0)
  flags.DEFINE_string("working_dir", None, "Container working directory.")
  flags.DEFINE_float("checkpoint_write_gbps", gke.DEFAULT_WRITE_GBPS,
                     "Write bandwidth of one host to the checkpoint storage, Gbit/s: sets "
                     "the pods' terminationGracePeriodSeconds (docs/contracts.md).")
  flags.DEFINE_float("checkpoint_gib", None,
                     "Checkpoint size in GiB (params + optimizer state), when the "
                     "command's Gin config does not give the model (default: derived).",
                     lower_bound=0)
  common.define_cluster_flags("Print the manifest only.")
  for name in ("name", "image", "tpu_type"):
    flags.mark_flag_as_required(name)


def main(argv: Sequence[str]) -> None:
  command = common.child_command(argv)
  tpu_slice = TpuSlice(FLAGS.tpu_type, FLAGS.topology)
  replica = common.gin_literal(command, "MeshConfig.replica")
  replica = 1 if replica is None else replica  # MeshConfig's default
  if FLAGS.num_slices > 1 and replica != FLAGS.num_slices:
    print(f"# note: {FLAGS.num_slices} slices; the command should set "
          f"MeshConfig.replica={FLAGS.num_slices} so the batch spans slices (its Gin "
          f"config gives {replica}; see configs/mesh/multislice_fsdp.gin)", file=sys.stderr)
  if gke.runs_under_shell(command):
    print("# note: the container runs a shell script; Kubernetes sends SIGTERM to it, not "
          "to the trainer, and a shell does not pass it on: end the script with `exec "
          "python -m pretrain.train ...`", file=sys.stderr)
  if FLAGS.checkpoint_gib is not None:
    size, source = int(FLAGS.checkpoint_gib * 2**30), "--checkpoint_gib"
  else:
    size, source = gke.checkpoint_bytes(command), "the command's ModelConfig"
  grace = gke.termination_grace_s(size, tpu_slice.hosts, FLAGS.checkpoint_write_gbps)
  if size is None:
    why = (f"checkpoint size unknown (no ModelConfig in the command's Gin config; set "
           f"--checkpoint_gib): the floor of {gke.MIN_GRACE_S} s")
  else:
    write_s = gke.write_seconds(size, tpu_slice.hosts, FLAGS.checkpoint_write_gbps)
    why = (f"{gke.SIGNAL_MARGIN_S} s + {write_s} s to write {size / 2**30:.1f} GiB ({source}) "
           f"/ {tpu_slice.hosts} hosts at {FLAGS.checkpoint_write_gbps:g} Gbit/s each + "
           f"{gke.EXIT_MARGIN_S} s, within [{gke.MIN_GRACE_S}, {gke.MAX_GRACE_S}] s")
    if gke.SIGNAL_MARGIN_S + write_s + gke.EXIT_MARGIN_S > gke.MAX_GRACE_S:
      print(f"# note: a save needs more than GKE's {gke.MAX_GRACE_S} s limit; a preemption "
            "may lose the steps since the last periodic checkpoint", file=sys.stderr)
  manifest = common.to_yaml(gke.jobset_manifest(
      FLAGS.name, FLAGS.image, command, tpu_slice, FLAGS.num_slices,
      common.parse_env_flags(FLAGS.env), FLAGS.max_restarts, FLAGS.working_dir, grace))
  print(f"# terminationGracePeriodSeconds: {grace} ({why})", flush=True)
  if FLAGS.dry_run:
    sys.stdout.write(manifest)
    return
  code = scheduler.run(["kubectl", "apply", "-f", "-"], stdin=manifest).returncode
  if code != 0:   # a refusal (no cluster credentials, no permission, a bad manifest)
    raise UserError(f"kubectl apply exited with code {code} (its message is above)")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
