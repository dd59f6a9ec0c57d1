"""The memory planner's analytic plan against the TPU or GPU compiler's peak, for one run.

`pretrain.summary --mesh` answers instantly from `model.memory`'s analytic model; this
script compiles the trainer's own train step for a TPU slice or GPUs (`pretrain.compile`:
libtpu's XLA:TPU and Mosaic, or the CUDA plugin's XLA:GPU, Triton and ptxas, on this
host, no accelerator needed) and prints both per device, with
the ratio, so the analytic model can be held against the compiler (benchmarks/RESULTS.md,
"Planner against the compiler"). "compiled activations" is the peak less the arguments
(parameters, AdamW moments and the batch) and less the float32 gradients (the planner's
exact parameter shard), the part the analytic activation model estimates; compile time is
given as wall and CPU seconds (on a shared host the wall time mostly measures the other
jobs).

Example (run it under `nice -n 19` on a shared machine):
  python benchmarks/planner_vs_compiler.py --topology=v5p-8 --mesh=fsdp:4 \
      --gin_file=configs/models/griffin_1_3b.gin --gin_param=ModelConfig.depth=3 \
      --gin_param='ModelConfig.remat="full"' --gin_param=BATCH_SIZE=16 \
      --gin_param=SEQUENCE_LENGTH=2048 [--record=benchmarks/results/planner_vs_compiler.json]

`--record` adds the compiled figures (bytes, compile time, the command's arguments and
XLA_FLAGS) to a JSON list, replacing an earlier record of the same run;
tests/test_memory_planner.py holds the analytic plan against every record there.

On GPU, XLA's rematerialisation pass recomputes activations until the step's peak fits
the device's memory (`device_memory_size` in the target's spec, times
--xla_gpu_memory_limit_slop_factor percent, 95 by default), so a step that does not fit
compiles to a peak between the device's memory and its own. The planner estimates the
latter: for such runs, `XLA_FLAGS=--xla_gpu_memory_limit_slop_factor=1000` lifts the
limit to ten times the memory (benchmarks/RESULTS.md, "Against XLA:GPU").
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import datetime
import importlib.metadata
import json
import os
import shlex
import sys
from typing import Any, Sequence

from absl import flags
import jax

from model import memory
from plumbing import cli
from pretrain import compile as compile_lib
from pretrain.compilation import aot
from pretrain import gin_config
from pretrain.compilation import gpu_target
from sharding.mesh import parse_mesh_flag

FLAGS = flags.FLAGS
GIB = 2 ** 30


def compare(topology: str, gin_files: Sequence[str], gin_params: Sequence[str],
            mesh: str) -> dict[str, Any]:
  """Compiled and analytic per-chip memory (bytes, GiB) of the run the Gin files describe."""
  report, _ = compile_lib.compile_from_gin(topology, 1, gin_files, gin_params, mesh)
  # Planned for the platform compiled for, whose kernels (fused attention) it follows.
  config = aot.for_target(gin_config.build_model_config(), report.platform)
  plan = memory.plan_memory(config, parse_mesh_flag(mesh), report.batch_size,
                            report.sequence_length)
  compiled_activations = report.peak_bytes - report.argument_bytes - plan["gradients"]
  return {
      "topology": topology, "mesh": mesh, "gin_files": list(gin_files),
      "gin_params": list(gin_params), "remat": config.remat,
      "batch_size": report.batch_size, "sequence_length": report.sequence_length,
      "compiled_peak_bytes": report.peak_bytes,
      "compiled_argument_bytes": report.argument_bytes,
      "compiled_temp_bytes": report.temp_bytes,
      "compiled_peak_gib": report.peak_bytes / GIB,
      "compiled_arguments_gib": report.argument_bytes / GIB,
      "compiled_temporaries_gib": report.temp_bytes / GIB,
      "compiled_activations_gib": compiled_activations / GIB,
      "analytic_total_gib": plan["total"] / GIB,
      "analytic_activations_gib": plan["activations"] / GIB,
      "total_ratio": plan["total"] / report.peak_bytes,
      "activation_ratio": plan["activations"] / max(compiled_activations, 1),
      "compile_wall_s": report.compile_seconds,
      "compile_cpu_s": report.compile_cpu_seconds,
  }


def record(path: str, result: dict[str, Any]) -> None:
  """Adds `result` to the JSON list at `path`, replacing a record of the same run."""
  key = lambda r: (r["topology"], r["mesh"], r["gin_files"], r["gin_params"],
                   r.get("xla_flags", ""))
  records = []
  if os.path.exists(path):
    with open(path) as f:
      records = [r for r in json.load(f) if key(r) != key(result)]
  with open(path, "w") as f:
    json.dump(records + [result], f, indent=1)
    f.write("\n")


def _compiler(topology: str) -> str:
  """The compiler package and release that compiles for `topology`."""
  if gpu_target.is_gpu_name(topology):
    return f"jax-cuda12-plugin {importlib.metadata.version('jax-cuda12-plugin')}"
  return f"libtpu {importlib.metadata.version('libtpu')}"


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  jax.config.update("jax_platforms", "cpu")  # compile only: no TPU or GPU runtime here
  result = compare(FLAGS.topology, FLAGS.gin_file, FLAGS.gin_param, FLAGS.mesh)
  if FLAGS.record:
    kept = {k: v for k, v in result.items() if not k.endswith(("_gib", "_ratio"))}
    name = " ".join([os.path.basename(FLAGS.gin_file[-1]).removesuffix(".gin")]
                    + list(FLAGS.gin_param))
    xla_flags = os.environ.get("XLA_FLAGS", "")
    env = f"XLA_FLAGS={shlex.quote(xla_flags)} " if xla_flags else ""
    record(FLAGS.record, {"name": name, **kept, "xla_flags": xla_flags,
                          "command": env + "python " + " ".join(map(shlex.quote, sys.argv)),
                          "date": datetime.date.today().isoformat(),
                          "compiler": f"{_compiler(FLAGS.topology)} (jax {jax.__version__}), "
                                      "ahead of time"})
  print(json.dumps(result))


if __name__ == "__main__":
  cli.define_gin_flags()
  flags.DEFINE_string("topology", None, "TPU slice type (v5p-128) or GPUs (h100-32).")
  flags.DEFINE_string("mesh", None, "Mesh over all chips, e.g. fsdp:16,tensor:4.")
  flags.DEFINE_string("record", None, "Add the compiled figures to this JSON list.")
  flags.mark_flags_as_required(["topology", "mesh"])
  cli.run(main)
