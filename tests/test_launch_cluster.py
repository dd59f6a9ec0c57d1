"""Dry runs of the TPU VM, GKE and SLURM launchers: the rendered commands, manifests and
scripts parse, and carry the right worker counts and environment."""
import os
import pathlib
import shlex
import subprocess
import sys

import pytest
import yaml

from launch.clusters import common
from launch.clusters import gke
from plumbing.errors import EXIT_USAGE, UserError
from sharding.tpu_slice import TpuSlice
from tiers import slow_after_first

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAIN = ["python", "-m", "pretrain.train", "--gin_file=configs/models/griffin_7b.gin",
         "--gin_param=MeshConfig.fsdp=16", "--gin_param=MeshConfig.tensor=4",
         "--gin_param=TRAIN_FILES='gs://b/data/*.txt'", "--workdir=gs://b/runs/g7b"]


def _run(module, *args):
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True,
                        text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def _dry_run(module, *flags, command=TRAIN):
  result = _run(module, *flags, "--dry_run", "--", *command)
  assert result.returncode == 0, result.stderr
  return result.stdout, result.stderr


def test_tpu_vm_dry_run_runs_train_command_on_all_workers():
  out, _ = _dry_run("launch.tpu_vm", "--tpu=my-slice", "--zone=us-east5-a",
                    "--project=proj", "--tpu_type=v5p-128",
                    "--setup=source ~/venv/bin/activate", "--env=WANDB_MODE=offline",
                    "--env=XLA_FLAGS=--xla_tpu_enable_latency_hiding_scheduler=true",
                    "--max_restarts=0")  # the plain command; retries: test_launch_recovery
  header, line = out.strip().splitlines()
  assert header == "# v5p-128: 16 workers x 4 chips (topology 4x4x4); one process per worker"
  argv = shlex.split(line)
  assert argv[:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-slice",
                      "--zone=us-east5-a", "--project=proj"]
  assert argv[8] == "--worker=all"
  remote = argv[9]
  assert remote.startswith("--command=")
  steps = remote[len("--command="):].split(" && ")
  assert steps[:2] == ["cd griffin-pretrain", "source ~/venv/bin/activate"]
  remote_argv = shlex.split(steps[2])
  assert remote_argv[:2] == ["WANDB_MODE=offline",
                             "XLA_FLAGS=--xla_tpu_enable_latency_hiding_scheduler=true"]
  assert remote_argv[2] == "exec"  # the trainer replaces the shell and gets its SIGTERM
  assert remote_argv[3:] == TRAIN  # the quoted glob survives both shells' quoting


@pytest.mark.parametrize("tpu_type, chips, hosts, per_host, topology, label", [
    ("v5p-128", 64, 16, 4, "4x4x4", "tpu-v5p-slice"),
    ("v5p-8", 4, 1, 4, "2x2x1", "tpu-v5p-slice"),
    ("v4-32", 16, 4, 4, "2x2x4", "tpu-v4-podslice"),
    ("v5e-256", 256, 64, 4, "16x16", "tpu-v5-lite-podslice"),
    ("v5e-8", 8, 1, 8, "2x4", "tpu-v5-lite-podslice"),
    ("v6e-64", 64, 16, 4, "8x8", "tpu-v6e-slice"),
])
def test_tpu_slice_shapes(tpu_type, chips, hosts, per_host, topology, label):
  s = TpuSlice(tpu_type)
  assert (s.chips, s.hosts, s.chips_per_host, s.topology, s.gke_accelerator) == (
      chips, hosts, per_host, topology, label)


def test_tpu_slice_errors():
  with pytest.raises(UserError, match="must look like") as error:
    TpuSlice("v5x-128")
  assert error.value.exit_code == EXIT_USAGE
  with pytest.raises(UserError, match="has 64"):
    TpuSlice("v5p-128", topology="4x4x8")
  with pytest.raises(UserError, match="must look like 4x4x4"):
    TpuSlice("v5p-128", topology="4x4xa")
  with pytest.raises(UserError, match="whole number of chips"):
    TpuSlice("v5p-7")


@pytest.mark.parametrize("module, flags, fragment", slow_after_first([
    ("launch.tpu_vm", ["--tpu=t", "--dry_run"], "--zone"),
    ("launch.tpu_vm", ["--tpu=t", "--zone=z", "--env=1X=2", "--dry_run"], "NAME=VALUE"),
    ("launch.tpu_vm", ["--tpu=t", "--zone=z", "--tpu_type=v9-8", "--dry_run"],
     "must look like"),
    ("launch.gke", ["--name=n", "--image=i", "--tpu_type=v5p-128", "--num_slices=0"],
     "--num_slices"),
    ("launch.gke", ["--name=n", "--image=i", "--tpu_type=v5p-128", "--max_restarts=x"],
     "--max_restarts"),
    ("launch.gke", ["--name=n", "--image=i", "--tpu_type=v5p-128", "--topology=4x4"],
     "has 16 chips"),
    ("launch.slurm", ["--nodes=0", "--dry_run"], "--nodes"),
    ("launch.slurm", ["--nodes=1", "--gpus_per_node=-8", "--dry_run"], "--gpus_per_node"),
    ("launch.slurm", ["--dry_run"], "--nodes"),
], group=lambda case: case[0]))
def test_bad_flag_value_is_one_line_and_exit_code_2(module, flags, fragment):
  result = _run(module, *flags, "--", *TRAIN)
  assert result.returncode == 2, (result.stdout, result.stderr)
  assert "Traceback" not in result.stderr, result.stderr
  errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and fragment in errors[0], result.stderr
  assert result.stdout == ""


@pytest.mark.parametrize("module, flags", [
    ("launch.tpu_vm", ["--tpu=t", "--zone=z"]),
    ("launch.gke", ["--name=n", "--image=i", "--tpu_type=v4-8"]),
    ("launch.slurm", ["--nodes=1"]),
])
def test_command_must_follow_double_dash(module, flags):
  result = _run(module, *flags, "--dry_run", *TRAIN)
  assert result.returncode == 2, (result.stdout, result.stderr)
  errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and "after `--`" in errors[0], result.stderr


def _single_container(manifest):
  (job,) = manifest["spec"]["replicatedJobs"]
  pod = job["template"]["spec"]["template"]["spec"]
  (container,) = pod["containers"]
  return job, pod, container


def test_gke_single_slice_manifest():
  out, _ = _dry_run("launch.gke", "--name=g7b", "--image=img:1", "--tpu_type=v5p-128",
                    "--env=WANDB_MODE=offline")
  manifest = yaml.safe_load(out)
  assert manifest["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and manifest["kind"] == "JobSet"
  assert manifest["metadata"]["name"] == "g7b"
  job, pod, container = _single_container(manifest)
  assert job["replicas"] == 1
  assert job["template"]["spec"]["parallelism"] == 16
  assert job["template"]["spec"]["completions"] == 16
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                 "cloud.google.com/gke-tpu-topology": "4x4x4"}
  assert container["resources"]["limits"]["google.com/tpu"] == 4
  assert container["command"] == TRAIN
  assert container["env"] == [{"name": "WANDB_MODE", "value": "offline"}]


@pytest.mark.slow   # fast tier under 5 min: two dry runs (5 s); the single-slice manifest stays fast
def test_gke_multi_slice_manifest_joins_slices_over_dcn():
  command = TRAIN + ["--gin_param=MeshConfig.replica=2"]
  out, err = _dry_run("launch.gke", "--name=g14b", "--image=img:1", "--tpu_type=v5e-256",
                      "--num_slices=2", "--max_restarts=3", command=command)
  assert "MeshConfig.replica" not in err  # no warning: the command sets the replica axis
  manifest = yaml.safe_load(out)
  job, pod, container = _single_container(manifest)
  assert manifest["spec"]["failurePolicy"]["maxRestarts"] == 3
  assert job["replicas"] == 2 and job["template"]["spec"]["completions"] == 64
  assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "16x16"
  env = {e["name"]: e for e in container["env"]}
  assert env["MEGASCALE_NUM_SLICES"]["value"] == "2"
  assert env["MEGASCALE_COORDINATOR_ADDRESS"]["value"] == (
      "$(JOBSET_NAME)-$(REPLICATED_JOB_NAME)-0-0.$(JOBSET_NAME)")
  assert env["MEGASCALE_SLICE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
      "metadata.labels['jobset.sigs.k8s.io/job-index']")
  # Variables are defined before the ones that reference them.
  names = [e["name"] for e in container["env"]]
  assert names.index("JOBSET_NAME") < names.index("MEGASCALE_COORDINATOR_ADDRESS")
  # Without the replica axis in the command, the launcher says so.
  _, err = _dry_run("launch.gke", "--name=g", "--image=i", "--tpu_type=v5e-256",
                    "--num_slices=2")
  assert "MeshConfig.replica=2" in err


@pytest.mark.slow   # fast tier under 5 min: several dry runs (8 s)
def test_gke_grace_period_follows_the_checkpoint_size():
  # griffin_7b: 6.92e9 params x 12 bytes = 83.1 GB; over v5p-128's 16 hosts 5.19 GB each,
  # 21 s at 2 Gbit/s: 60 + 21 + 30 = 111 s, raised to the 120 s floor.
  size = gke.checkpoint_bytes(TRAIN)
  assert size == 6_924_400_640 * gke.CHECKPOINT_BYTES_PER_PARAM
  assert gke.write_seconds(size, 16, 2.0) == 21
  assert gke.termination_grace_s(size, 16) == gke.MIN_GRACE_S == 120
  assert gke.termination_grace_s(size, 16, write_gbps=0.5) == 60 + 84 + 30
  assert gke.termination_grace_s(size, 1) == 60 + 333 + 30  # one host writes it all
  assert gke.termination_grace_s(100 * size, 1) == gke.MAX_GRACE_S == 3600
  assert gke.termination_grace_s(None, 16) == gke.MIN_GRACE_S
  out, _ = _dry_run("launch.gke", "--name=g", "--image=i", "--tpu_type=v5p-128",
                    "--checkpoint_gib=1000")
  grace = 60 + 269 + 30  # 1000 GiB / 16 hosts at 2 Gbit/s: 269 s
  assert out.startswith(f"# terminationGracePeriodSeconds: {grace} (60 s + 269 s to write")
  _, pod, container = _single_container(yaml.safe_load(out))
  assert pod["terminationGracePeriodSeconds"] == grace
  assert container["command"] == TRAIN  # no shell between Kubernetes and the trainer
  _, err = _dry_run("launch.gke", "--name=g", "--image=i", "--tpu_type=v5p-8",
                    command=["sh", "-c", "cd /app; python -m pretrain.train"])
  assert "end the script with `exec" in err
  _, err = _dry_run("launch.gke", "--name=g", "--image=i", "--tpu_type=v5p-8",
                    command=["sh", "-c", "cd /app && exec python -m pretrain.train"])
  assert "exec" not in err


def test_yaml_renderer_round_trips_awkward_strings():
  manifest = gke.jobset_manifest("n", "i", ["bash", "-c", "echo 'a: b' \"$(X)\" # c\n"],
                                 TpuSlice("v4-8"), env={"K": "yes", "N": "007"})
  assert yaml.safe_load(common.to_yaml(manifest)) == manifest


def test_slurm_script_runs_one_task_per_gpu():
  out, _ = _dry_run("launch.slurm", "--nodes=4", "--gpus_per_node=8", "--partition=gpu",
                    "--time=24:00:00", "--setup=source ~/venv/bin/activate",
                    "--env=NCCL_DEBUG=WARN")
  lines = out.splitlines()
  assert lines[0] == "#!/bin/bash"
  directives = [l.split(" ", 1)[1] for l in lines if l.startswith("#SBATCH")]
  for expected in ("--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8",
                   "--partition=gpu", "--time=24:00:00"):
    assert expected in directives
  assert "source ~/venv/bin/activate" in lines and "export NCCL_DEBUG=WARN" in lines
  srun = next(l for l in lines if l.startswith("srun "))
  # Requeueing is on by default: srun runs in the background under the signal traps.
  assert shlex.split(srun) == ["srun", "--kill-on-bad-exit=1"] + TRAIN + ["&"]
  for expected in ("--requeue", "--signal=B:USR1@120"):
    assert expected in directives
  # The script is valid bash.
  script = "\n".join(l for l in lines if not l.startswith("# submit"))
  assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_gin_literal_follows_files_includes_and_params_in_order(tmp_path):
  base = tmp_path / "base.gin"
  base.write_text("MeshConfig.replica = 3  # a comment\nMeshConfig.fsdp = -1\n")
  top = tmp_path / "top.gin"
  top.write_text(f"include '{base}'\nMeshConfig.data = 1\n")
  command = ["python", "-m", "pretrain.train", f"--gin_file={top}"]
  assert common.gin_literal(command, "MeshConfig.replica") == 3
  assert common.gin_literal(command + ["--gin_param=MeshConfig.replica=2"],
                            "MeshConfig.replica") == 2
  assert common.gin_literal(command, "MeshConfig.tensor") is None
  multislice = ["--gin_file=configs/base/trainer.gin",
                "--gin_file=configs/mesh/multislice_fsdp.gin"]
  assert common.gin_literal(multislice, "MeshConfig.replica") == 2
  # A macro reference takes the macro's last value, wherever it is bound.
  macro = ["--gin_file=configs/models/griffin_7b.gin", "--gin_param=VOCAB_SIZE=256"]
  assert common.gin_literal(macro, "ModelConfig.vocab_size") == 256
  assert common.gin_literal(macro[:1], "ModelConfig.vocab_size") == 32768
