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
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any, Optional, Sequence

from launch import common

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "slice"


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


def jobset_manifest(name: str, image: str, command: Sequence[str], tpu_slice: common.TpuSlice,
                    num_slices: int = 1, env: Optional[dict[str, str]] = None,
                    max_restarts: int = 0, working_dir: Optional[str] = None) -> dict[str, Any]:
  """The JobSet as a plain dict (render with `common.to_yaml`)."""
  if num_slices < 1:
    raise SystemExit("--num_slices must be >= 1")
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


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m launch.gke", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--name", required=True, help="JobSet name (DNS label)")
  parser.add_argument("--image", required=True, help="container image with this repository")
  parser.add_argument("--tpu_type", required=True, help="slice type, e.g. v5p-128")
  parser.add_argument("--topology", default=None, help="override, e.g. 4x4x4")
  parser.add_argument("--num_slices", type=int, default=1)
  parser.add_argument("--max_restarts", type=int, default=0,
                      help="JobSet restarts after a failure (training resumes from the "
                           "latest checkpoint)")
  parser.add_argument("--working_dir", default=None, help="container working directory")
  parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
  parser.add_argument("--dry_run", action="store_true", help="print the manifest only")
  args, command = common.parse_launcher_args(parser, sys.argv[1:] if argv is None else argv)
  tpu_slice = common.TpuSlice(args.tpu_type, args.topology)
  if args.num_slices > 1 and "MeshConfig.replica" not in " ".join(command):
    print(f"# note: {args.num_slices} slices; the command should set "
          f"MeshConfig.replica={args.num_slices} so the batch spans slices", file=sys.stderr)
  manifest = common.to_yaml(jobset_manifest(
      args.name, args.image, command, tpu_slice, args.num_slices,
      common.parse_env_flags(args.env), args.max_restarts, args.working_dir))
  if args.dry_run:
    sys.stdout.write(manifest)
    return 0
  return subprocess.run(["kubectl", "apply", "-f", "-"], input=manifest, text=True,
                        check=False).returncode


if __name__ == "__main__":
  sys.exit(main())
