"""Runs a command on one or more TPU slices of a GKE cluster as a JobSet.

  python -m launch.gke --name=griffin-7b --image=us-docker.pkg.dev/P/repo/griffin:latest \\
      --tpu_type=v5p-128 --num_slices=2 --dry_run -- \\
      python -m pretrain.train --gin_file=configs/models/griffin_7b.gin \\
      --gin_param='MeshConfig.replica=2' --gin_param='MeshConfig.fsdp=16' \\
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

`SweepBackend` is `launch.sweep --backend=gke`: one single-slice JobSet per run.
"""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from typing import Any, Optional, Sequence

from absl import flags

from launch import common
from launch import sweep_dispatch
from model import counting
from model.config import ModelConfig
from plumbing import cli
from plumbing.errors import usage_error
from sharding.tpu_slice import TpuSlice

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "slice"

# -- termination grace (docs/contracts.md, "Preemption per launcher") -------------------
# A checkpoint holds the float32 parameters and AdamW's two float32 moments (optax's
# adamw keeps mu and nu in the parameters' dtype; pretrain/optimizer.py), plus the step.
CHECKPOINT_BYTES_PER_PARAM = 12
# Sustained write bandwidth of one host to the checkpoint bucket, in gigabits per second:
# conservative for a TPU VM host writing to GCS (250 MB/s; measured rates are higher).
DEFAULT_WRITE_GBPS = 2.0
# Before the write: the step in flight ends and every process agrees on the step to save.
SIGNAL_MARGIN_S = 60
# After the write: Orbax's commit, the integrity manifest, the metrics and process exit.
EXIT_MARGIN_S = 30
MIN_GRACE_S = 120
# GKE's documented upper bound for the grace it honours on GPU/TPU nodes' maintenance
# events (one hour); a larger value is not waited for, so the rule stops there.
MAX_GRACE_S = 3600
SHELLS = ("sh", "bash", "dash", "zsh")


def checkpoint_bytes(command: Sequence[str]) -> Optional[int]:
  """Bytes of a checkpoint of the model the training command's Gin config describes
  (`CHECKPOINT_BYTES_PER_PARAM` per parameter), or None when its ModelConfig cannot be
  read from the literal bindings (`common.gin_literals`)."""
  literals = common.gin_literals(command)
  prefix = "ModelConfig."
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  values = {name[len(prefix):]: value for name, value in literals.items()
            if name.startswith(prefix) and name[len(prefix):] in fields}
  if "width" not in values or "depth" not in values:
    return None  # no model preset in the command: no estimate
  try:
    params = counting.analytic_param_counts(ModelConfig(**values)).total
  except (TypeError, ValueError, KeyError):
    return None
  return params * CHECKPOINT_BYTES_PER_PARAM


def termination_grace_s(total_bytes: Optional[int], hosts: int,
                        write_gbps: float = DEFAULT_WRITE_GBPS) -> int:
  """Seconds a pod gets between SIGTERM and SIGKILL to save its step:

      SIGNAL_MARGIN_S + ceil(total_bytes / hosts * 8 / (write_gbps * 1e9)) + EXIT_MARGIN_S

  clamped to [MIN_GRACE_S, MAX_GRACE_S]. Each slice holds the whole state sharded
  over its `hosts`, and each host writes its own shards, so one host writes
  total/hosts bytes. Unknown size (None): MIN_GRACE_S."""
  if total_bytes is None:
    return MIN_GRACE_S
  needed = SIGNAL_MARGIN_S + write_seconds(total_bytes, hosts, write_gbps) + EXIT_MARGIN_S
  return max(MIN_GRACE_S, min(MAX_GRACE_S, needed))


def write_seconds(total_bytes: int, hosts: int, write_gbps: float) -> int:
  """Seconds one of `hosts` takes to write its share of a `total_bytes` checkpoint."""
  if not write_gbps > 0:
    raise usage_error("--checkpoint_write_gbps must be > 0")
  return math.ceil(total_bytes / max(hosts, 1) * 8 / (write_gbps * 1e9))


def runs_under_shell(command: Sequence[str]) -> bool:
  """Whether the container would run a shell script that keeps the shell as PID 1 (it
  does not forward SIGTERM): `sh -c '...'` whose script does not `exec` the trainer."""
  if len(command) < 3 or os.path.basename(command[0]) not in SHELLS or command[1] != "-c":
    return False
  last = command[2].strip().replace("\n", ";").split(";")[-1].split("&&")[-1].strip()
  return not last.startswith("exec ")


def _field_env(name: str, field_path: str) -> dict[str, Any]:
  return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def container_env(num_slices: int, extra: dict[str, str]) -> list[dict[str, Any]]:
  """Environment of the training container: Megascale for multi-slice, then the user's."""
  env: list[dict[str, Any]] = []
  if num_slices > 1:
    env += [
        _field_env("JOBSET_NAME", "metadata.annotations['jobset.sigs.k8s.io/jobset-name']"),
        _field_env("REPLICATED_JOB_NAME",
                   "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']"),
        {"name": "MEGASCALE_COORDINATOR_ADDRESS",
         "value": "$(JOBSET_NAME)-$(REPLICATED_JOB_NAME)-0-0.$(JOBSET_NAME)"},
        {"name": "MEGASCALE_NUM_SLICES", "value": str(num_slices)},
        _field_env("MEGASCALE_SLICE_ID", "metadata.labels['jobset.sigs.k8s.io/job-index']"),
    ]
  env += [{"name": name, "value": value} for name, value in extra.items()]
  return env


def jobset_manifest(name: str, image: str, command: Sequence[str], tpu_slice: TpuSlice,
                    num_slices: int = 1, env: Optional[dict[str, str]] = None,
                    max_restarts: int = common.DEFAULT_MAX_RESTARTS,
                    working_dir: Optional[str] = None,
                    grace_s: int = MIN_GRACE_S) -> dict[str, Any]:
  """The JobSet as a plain dict (render with `common.to_yaml`); `grace_s` is the pods'
  terminationGracePeriodSeconds (`termination_grace_s`)."""
  if num_slices < 1:
    raise usage_error("--num_slices must be >= 1")
  container = {
      "name": "train",
      "image": image,
      "command": list(command),
      "env": container_env(num_slices, env or {}),
      "ports": [{"containerPort": 8471}, {"containerPort": 8080}],
      "securityContext": {"privileged": True},
      "resources": {"limits": {"google.com/tpu": tpu_slice.chips_per_host}},
  }
  if working_dir:
    container["workingDir"] = working_dir
  pod_spec = {
      "restartPolicy": "Never",
      "hostNetwork": True,
      "dnsPolicy": "ClusterFirstWithHostNet",
      "terminationGracePeriodSeconds": int(grace_s),
      "nodeSelector": {
          "cloud.google.com/gke-tpu-accelerator": tpu_slice.gke_accelerator,
          "cloud.google.com/gke-tpu-topology": tpu_slice.topology,
      },
      "containers": [container],
  }
  return {
      "apiVersion": JOBSET_API,
      "kind": "JobSet",
      "metadata": {
          "name": name,
          # One slice per node pool: the pods of a replica land on one physical slice.
          "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology":
                          "cloud.google.com/gke-nodepool"},
      },
      "spec": {
          "failurePolicy": {"maxRestarts": max_restarts},
          "replicatedJobs": [{
              "name": REPLICATED_JOB,
              "replicas": num_slices,
              "template": {"spec": {
                  "parallelism": tpu_slice.hosts,
                  "completions": tpu_slice.hosts,
                  "completionMode": "Indexed",
                  "backoffLimit": 0,
                  "template": {"spec": pod_spec},
              }},
          }],
      },
  }


@dataclasses.dataclass(frozen=True)
class SweepBackend(sweep_dispatch.ClusterBackend):
  """`launch.sweep --backend=gke`: one JobSet per run, each on one `tpu_type` slice
  and running `image` (sweep_dispatch.Backend)."""
  image: Optional[str] = None
  tpu_type: Optional[str] = None

  name = "gke"

  def define_flags(self) -> None:
    self.define_cluster_flags(tpu=True)
    flags.DEFINE_string("image", self.image, "gke: container image with this repository.")

  def from_flags(self, values: flags.FlagValues) -> SweepBackend:
    sweep_dispatch.require_flags(values, self.name, ("image", "tpu_type"))
    TpuSlice(values.tpu_type)  # a bad type is a usage error now, not at submission
    return dataclasses.replace(self, **self.cluster_flags(values), image=values.image,
                               tpu_type=values.tpu_type)

  def submissions(self, jobs: Sequence[sweep_dispatch.Job], attempt: int,
                  study_dir: str) -> list[sweep_dispatch.Submission]:
    """One JobSet manifest (YAML) per job, applied with kubectl."""
    del study_dir  # the pods' logs stay in the cluster
    tpu_slice = TpuSlice(self.tpu_type)
    manifests = [common.to_yaml(jobset_manifest(
        sweep_dispatch.dns_name(self.job_name, job.name, suffix=f"a{attempt}"), self.image,
        job.wrapped(), tpu_slice, env=self.env,
        grace_s=termination_grace_s(checkpoint_bytes(job.command), tpu_slice.hosts)))
                 for job in jobs]
    return [sweep_dispatch.Submission(["kubectl", "apply", "-f", "-"], manifest,
                                      manifest if i == 0 else "---\n" + manifest)
            for i, manifest in enumerate(manifests)]


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
  flags.DEFINE_float("checkpoint_write_gbps", DEFAULT_WRITE_GBPS,
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
  if runs_under_shell(command):
    print("# note: the container runs a shell script; Kubernetes sends SIGTERM to it, not "
          "to the trainer, and a shell does not pass it on: end the script with `exec "
          "python -m pretrain.train ...`", file=sys.stderr)
  if FLAGS.checkpoint_gib is not None:
    size, source = int(FLAGS.checkpoint_gib * 2**30), "--checkpoint_gib"
  else:
    size, source = checkpoint_bytes(command), "the command's ModelConfig"
  grace = termination_grace_s(size, tpu_slice.hosts, FLAGS.checkpoint_write_gbps)
  if size is None:
    why = (f"checkpoint size unknown (no ModelConfig in the command's Gin config; set "
           f"--checkpoint_gib): the floor of {MIN_GRACE_S} s")
  else:
    write_s = write_seconds(size, tpu_slice.hosts, FLAGS.checkpoint_write_gbps)
    why = (f"{SIGNAL_MARGIN_S} s + {write_s} s to write {size / 2**30:.1f} GiB ({source}) "
           f"/ {tpu_slice.hosts} hosts at {FLAGS.checkpoint_write_gbps:g} Gbit/s each + "
           f"{EXIT_MARGIN_S} s, within [{MIN_GRACE_S}, {MAX_GRACE_S}] s")
    if SIGNAL_MARGIN_S + write_s + EXIT_MARGIN_S > MAX_GRACE_S:
      print(f"# note: a save needs more than GKE's {MAX_GRACE_S} s limit; a preemption "
            "may lose the steps since the last periodic checkpoint", file=sys.stderr)
  manifest = common.to_yaml(jobset_manifest(
      FLAGS.name, FLAGS.image, command, tpu_slice, FLAGS.num_slices,
      common.parse_env_flags(FLAGS.env), FLAGS.max_restarts, FLAGS.working_dir, grace))
  print(f"# terminationGracePeriodSeconds: {grace} ({why})", flush=True)
  if FLAGS.dry_run:
    sys.stdout.write(manifest)
    return
  sys.exit(subprocess.run(["kubectl", "apply", "-f", "-"], input=manifest, text=True,
                          check=False).returncode)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
