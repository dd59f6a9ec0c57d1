r"""Compile the trainer's exact train step for a TPU slice or GPU cluster from any host.

  python -m pretrain.compile --topology=v5p-128 --gin_file=configs/models/griffin_14b.gin \
      --gin_file=configs/mesh/fsdp_tensor4.gin --gin_param=BATCH_SIZE=256 [--num_slices=N] \
      [--mesh=fsdp:32,tensor:2] [--json] [--save=PATH]
  python -m pretrain.compile --topology=h100-32 [--gpus_per_node=8] ...

Runs the target's own compilers on this machine, no accelerator needed: libtpu's XLA:TPU
and Mosaic for a TPU slice (`pip install -e ".[tpu]"`), or the CUDA plugin's XLA:GPU,
Triton, Mosaic GPU and ptxas for GPUs (`pip install -e ".[gpu-aot]"`: kinds a100, h100,
h200, b200, specs in pretrain/compilation/gpu_specs/), over a mesh of the target's devices, on the
program the trainer jits (`pretrain.steps.jit_train_step`: optimizer, microbatches,
remat, dtypes, shardings; the scan as resolved on that platform). Prints per-device
memory (arguments, temporaries, peak) against the device's memory with fits / does not
fit, XLA's compiled FLOPs per device, the model FLOPs the trainer's MFU counts, the
Pallas kernels in the program, and the compile's wall and CPU time and peak host memory. Gin is read as
by `pretrain.train` (configs/base/trainer.gin and optimizer.gin first, then --gin_file in
order). `--save` writes the serialized executable (`jax.experimental.serialize_executable`,
pickled with its input/output trees). Exit status 1 when the step does not fit.
"""
from __future__ import annotations

import json
import os
import pickle
from typing import Sequence

import jax
from absl import flags
from jax.experimental import serialize_executable

from plumbing import cli
from plumbing import storage
from plumbing.errors import EXIT_FAILED, UserError, usage_error
from pretrain.compilation import aot
from pretrain import gin_config
from pretrain.compilation import gpu_target
from pretrain.compilation import tpu_target
from pretrain.optimizer import OptimizerConfig
from pretrain.train_config import TrainConfig
from sharding import partition
from sharding import rules as rules_lib
from sharding.mesh import MeshConfig, mesh_config_from_flag

FLAGS = flags.FLAGS
BASE_GIN = ("configs/base/trainer.gin", "configs/base/optimizer.gin")
GIB = 2 ** 30


def define_flags() -> None:
  cli.define_gin_flags()
  flags.DEFINE_string("topology", None, "TPU slice type: v5p-128, v4-32, v5e-16 (or "
                      "v5litepod-16), v6e-64; or GPUs: h100-32, h200-8, a100-64, b200-16.")
  flags.DEFINE_integer("num_slices", 1, "TPU slices joined over the data-centre network "
                       "(use a mesh with replica = num_slices).", lower_bound=1)
  flags.DEFINE_integer("gpus_per_node", gpu_target.DEFAULT_GPUS_PER_NODE,
                       "GPU targets: GPUs per host.", lower_bound=1)
  flags.DEFINE_string("mesh", None, "Mesh over all chips, e.g. 'fsdp:32,tensor:2' "
                      "(default: MeshConfig from Gin).")
  flags.DEFINE_bool("json", False, "Print one JSON object.")
  flags.DEFINE_string("save", None, "Write the serialized compiled executable here.")
  flags.mark_flag_as_required("topology")


def target_and_devices(topology: str, num_slices: int = 1,
                       gpus_per_node: int = gpu_target.DEFAULT_GPUS_PER_NODE
                       ) -> tuple[tpu_target.TpuTarget | gpu_target.GpuTarget, list]:
  """The target `--topology` names (a TPU slice or GPUs) and its device descriptions."""
  if not gpu_target.is_gpu_name(topology):
    target = tpu_target.parse_target(topology, num_slices)
    return target, tpu_target.target_devices(target)
  if num_slices != 1:
    raise usage_error(f"--num_slices is for TPU slices; {topology} is one GPU cluster "
                      "(set --gpus_per_node for its nodes)")
  target = gpu_target.parse_target(topology, gpus_per_node)
  return target, gpu_target.target_devices(target)


def compile_from_gin(topology: str, num_slices: int, gin_files: Sequence[str],
                     gin_params: Sequence[str], mesh: str | None = None,
                     gpus_per_node: int = gpu_target.DEFAULT_GPUS_PER_NODE
                     ) -> tuple[aot.CompileReport, object]:
  """(report, compiled step) of the run the Gin files describe, on the target."""
  target, devices = target_and_devices(topology, num_slices, gpus_per_node)
  gin_config.parse(list(BASE_GIN) + list(gin_files), gin_params)
  train_config = gin_config.build(TrainConfig)
  mesh_config = mesh_config_from_flag(mesh) if mesh else gin_config.build(MeshConfig)
  try:
    runtime = aot.target_runtime(gin_config.build_model_config(), mesh_config, devices,
                                 gin_config.build(rules_lib.logical_axis_rules),
                                 gin_config.build(partition.ReplicationCheck))
  except ValueError as error:
    raise usage_error(f"Bad sharding configuration for {target.devices} devices of "
                      f"{topology}: {error}") from error
  compiled, cost = aot.compile_train_step(runtime, train_config,
                                          gin_config.build(OptimizerConfig))
  return aot.report(compiled, cost, runtime, target, train_config), compiled


def format_report(report: aot.CompileReport) -> str:
  """The human-readable report."""
  gib = lambda n: f"{n / GIB:8.2f} GiB"
  mesh = ",".join(f"{name}:{size}" for name, size in report.mesh.items() if size > 1)
  verdict = "fits" if report.fits else "DOES NOT FIT"
  device = "GPU" if report.platform == "gpu" else "chip"
  compiled_flops = ("n/a" if report.compiled_flops is None
                    else f"{report.compiled_flops:.4g} per {device}, "
                    f"{report.compiled_flops * report.devices:.4g} in all")
  kernels = ", ".join(f"{count} {name}" for name, count in report.kernels.items())
  where = (f"{report.target}" if report.platform == "gpu"
           else f"{report.target} x {report.num_slices} slice(s)")
  return "\n".join([
      f"target:            {where}, {report.devices} {device}s, mesh {mesh or 'one device'}",
      f"step:              batch {report.batch_size} x {report.sequence_length} tokens, "
      f"{report.microbatches} microbatch(es), remat {report.model['remat']}, "
      f"scan {report.model['scan_impl']}{f' (kernels: {kernels})' if kernels else ''}",
      *_attention_lines(report),
      f"memory per {device} (XLA buffer assignment):",
      f"  arguments        {gib(report.argument_bytes)}   (state and batch)",
      f"  outputs          {gib(report.output_bytes)}   "
      f"({gib(report.alias_bytes).strip()} aliased to donated arguments)",
      f"  temporaries      {gib(report.temp_bytes)}",
      f"  peak             {gib(report.peak_bytes)}   of {gib(report.hbm_bytes).strip()} "
      f"device memory: {verdict}",
      f"compiled FLOPs:    {compiled_flops} (XLA cost analysis)",
      f"model FLOPs:       {report.model_flops:.4g} per step (as the trainer's MFU counts)",
      *_estimate_lines(report),
      f"compile time:      {report.compile_seconds:.1f} s "
      f"({report.compile_cpu_seconds:.1f} s of CPU in this process), host memory "
      f"peak {report.compile_host_peak_bytes / GIB:.2f} GiB resident",
  ])


def _attention_lines(report: aot.CompileReport) -> list[str]:
  """Which attention the step runs, its fused launches, or why XLA's path runs."""
  if report.attention is None:
    return []
  impl, reason = report.attention["impl"], report.attention["reason"]
  if impl == "xla":
    why = reason or f"AttentionOptions.impl={report.model['attention_impl']!r}"
    return [f"attention:         XLA (scores in HBM): {why}"]
  line = f"attention:         fused, {impl}"
  if report.declared_kernels:
    launches = report.declared_kernels["launches"]
    line += " (" + ", ".join(f"{n} {kind}" for kind, n in launches.items() if n) + " launches)"
  return [line]


def _estimate_lines(report: aot.CompileReport) -> list[str]:
  """XLA's cost-model estimate of the step, labelled as such."""
  if report.estimated_seconds is None:
    return ["estimated step:    n/a (this compiler gives no cost-model estimate)"]
  mfu = ("n/a" if report.estimated_mfu is None
         else f"{100 * report.estimated_mfu:.1f}% MFU")
  lines = [
      f"estimated step:    {1e3 * report.estimated_seconds:.2f} ms, "
      f"{report.estimated_tokens_per_second:.4g} tokens/s, {mfu} "
      "(XLA's cost model, not a measurement)",
      f"HBM traffic:       {report.bytes_accessed_per_token:.4g} bytes per token "
      f"({report.bytes_accessed / 1e9:.2f} GB per chip per step; XLA's estimate)"]
  declared = report.declared_kernels
  if declared:
    seconds = declared["seconds"] or 0.0
    lines.append(
        f"                   of which fused attention, declared here (XLA sees no FLOPs "
        f"in its custom calls): {1e3 * seconds:.2f} ms, {declared['flops']:.4g} FLOPs, "
        f"{declared['bytes'] / 1e9:.2f} GB per chip (model.blocks.attention.kernel_costs)")
  if report.while_loops:
    lines.append(f"                   the program has {report.while_loops} while loop(s), "
                 "whose bodies XLA counts once: the estimate undercounts (unroll the "
                 "depth, ModelConfig.depth_scan_unroll, for a whole count)")
  return lines


def save_executable(compiled: object, path: str) -> None:
  payload = serialize_executable.serialize(compiled)
  try:
    storage.write_bytes(path, pickle.dumps(payload))
  except OSError as error:
    raise UserError(f"Cannot write --save {path}: {error.strerror or error}") from None


def main(argv: Sequence[str]) -> int:
  cli.reject_extra_arguments(argv)
  if not os.environ.get("JAX_PLATFORMS"):
    # Compiling needs only the target's device descriptions; this host's own runtime
    # stays CPU (on a machine with libtpu or the CUDA plugin but no such device,
    # starting one would fail or wait).
    jax.config.update("jax_platforms", "cpu")
  report, compiled = compile_from_gin(FLAGS.topology, FLAGS.num_slices, FLAGS.gin_file,
                                      FLAGS.gin_param, FLAGS.mesh, FLAGS.gpus_per_node)
  if FLAGS.save:
    save_executable(compiled, FLAGS.save)
  print(json.dumps(report.as_dict()) if FLAGS.json else format_report(report))
  return 0 if report.fits else EXIT_FAILED


if __name__ == "__main__":
  define_flags()
  cli.run(main)
