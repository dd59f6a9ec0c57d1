"""Runs a command on one or more TPU slices of a GKE cluster as a JobSet.

The library of `python -m launch.gke` (launch/gke.py, whose docstring is the
command's manual; its flags and main are there).

`SweepBackend` is `launch.sweep --backend=gke`: one single-slice JobSet per run.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional, Sequence

from absl import flags

from launch.clusters import cluster_backend
from launch.clusters import common
from launch.dispatch import sweep_dispatch
from model import counting
from model.config import ModelConfig
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
class SweepBackend(cluster_backend.ClusterBackend):
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
