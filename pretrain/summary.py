"""`python -m pretrain.summary`: the size and cost of a model preset, without building it.

    python -m pretrain.summary --gin_file=F [--gin_file=G ...] [--gin_param='a.b=1' ...]
        [--seq=T] [--json]
        [--mesh=data:2,fsdp:4,tensor:1 --batch=B [--device_memory_gb=G]]

Prints the total and non-embedding parameter counts, the training FLOPs per token at
sequence length T (`model.counting`, docs/model.md) and the decoding state per sequence.
With `--mesh`, also the per-device memory of training with a global batch of B rows of T
tokens (`pretrain.memory_plan.plan_memory`). With `--json` it prints one JSON object instead:
`params_total`, `params_non_embedding`, `params_embedding`, `flops_per_token`,
`flops_breakdown`, `seq`, `decode_state_bytes`, `model` (the resolved ModelConfig as
checkpoints record it, `model.config.model_config_to_dict`) and, with a mesh,
`per_device_bytes: {params, optimizer, gradients, activations, workspace, total}` (total
counts the larger of activations and the optimizer update's workspace, never live
together; `model.memory`), `memory_fits` (null without
`--device_memory_gb`), `memory_method`, `mesh` and `batch`.

Everything is computed from shapes (`jax.eval_shape`), so the 14B presets take seconds.
The Gin files are read by `pretrain.gin_config` like the trainer's, so a full training
config (trainer, data and model bindings) works as well as a model preset. Bad input
ends the program with one `error: ...` line on stderr and exit status 2.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional, Sequence

from absl import flags

from model import counting
from model.config import ModelConfig, model_config_to_dict
from plumbing import cli
from plumbing.errors import usage_error
from pretrain import gin_config
from pretrain import memory_plan
from sharding.mesh import parse_mesh_flag

DEFAULT_SEQ = 2048  # the Griffin paper's training length

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Command-line flags, defined only when run as a program (see tests/test_entry_points)."""
  cli.define_gin_flags()
  flags.DEFINE_integer("seq", DEFAULT_SEQ, "Sequence length T for FLOPs and memory.",
                       lower_bound=1)
  flags.DEFINE_bool("json", False, "Print one JSON object.")
  flags.DEFINE_string("mesh", None,
                      "Device mesh, e.g. 'data:2,fsdp:4,tensor:1': adds per-device memory.")
  flags.DEFINE_integer("batch", None, "Global batch in sequences (with --mesh).",
                       lower_bound=1)
  flags.DEFINE_float("device_memory_gb", None,
                     "Device memory in GB to check the plan against (with --mesh).")
  flags.register_multi_flags_validator(
      ["mesh", "batch", "device_memory_gb"],
      lambda values: values["mesh"] is not None or (
          values["batch"] is None and values["device_memory_gb"] is None),
      message="--batch and --device_memory_gb need --mesh")
  flags.register_multi_flags_validator(
      ["mesh", "batch"], lambda values: values["mesh"] is None or values["batch"] is not None,
      message="--mesh needs --batch (the global batch in sequences)")


def load_model_config(gin_files: Sequence[str], gin_params: Sequence[str]) -> ModelConfig:
  """Parses the Gin files and bindings and returns the ModelConfig they describe.

  Raises:
    UserError (exit code 2): a missing file, a bad binding or a rejected value.
  """
  gin_config.parse(gin_files, gin_params)
  return gin_config.build_model_config()


def summarize(config: ModelConfig, seq: int, mesh: Optional[str] = None, batch: Optional[int] = None,
              device_memory_gb: Optional[float] = None) -> dict[str, Any]:
  """The summary of `config` as a JSON-ready dict (see the module docstring)."""
  params = counting.count_params(config)
  flops = counting.training_flops_breakdown(config, seq)
  result: dict[str, Any] = {
      "params_total": params.total,
      "params_non_embedding": params.non_embedding,
      "params_embedding": params.embedding,
      "flops_per_token": flops.total,
      "flops_breakdown": dataclasses.asdict(flops),
      "seq": seq,
      "decode_state_bytes": counting.decode_state_bytes(config, max_length=seq),
      "model": model_config_to_dict(config),
  }
  if mesh is not None:
    result.update(_memory_plan(config, mesh, batch, seq, device_memory_gb))
  return result


def _memory_plan(config: ModelConfig, mesh: str, batch: Optional[int], seq: int,
                 device_memory_gb: Optional[float]) -> dict[str, Any]:
  """`pretrain.memory_plan.plan_memory` for the `--mesh` flag, trimmed to JSON-ready fields."""
  if batch is None:
    raise usage_error("--mesh needs --batch (the global batch in sequences)")
  try:
    plan = memory_plan.plan_memory(config, parse_mesh_flag(mesh), batch, seq,
                              device_memory_gb=device_memory_gb)
  except ValueError as error:  # an invalid mesh, or one that does not fit the model
    raise usage_error(" ".join(str(error).split())) from None
  keys = ("params", "optimizer", "gradients", "activations", "workspace", "total")
  return {"per_device_bytes": {key: int(plan[key]) for key in keys if key in plan},
          "memory_fits": plan.get("fits"), "memory_method": plan.get("method"),
          "mesh": plan.get("mesh"), "batch": batch}


def _human(n: float) -> str:
  for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.2f}{unit}"
  return f"{n:.0f}"


def _human_bytes(n: float) -> str:
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n:.0f} B"


def format_text(summary: dict[str, Any]) -> str:
  """The human-readable report."""
  b = summary["flops_breakdown"]
  lines = [
      f"parameters, total:          {summary['params_total']:,} ({_human(summary['params_total'])})",
      f"parameters, non-embedding:  {summary['params_non_embedding']:,} "
      f"({_human(summary['params_non_embedding'])})",
      f"parameters, embedding:      {summary['params_embedding']:,}",
      f"training FLOPs per token:   {summary['flops_per_token']:.4g} at T={summary['seq']} "
      f"(matmuls {b['matmul']:.3g}, output projection {b['output_projection']:.3g}, "
      f"attention {b['attention']:.3g}, recurrence {b['recurrence']:.3g})",
      f"decode state per sequence:  {summary['decode_state_bytes']:,} bytes "
      f"({_human_bytes(summary['decode_state_bytes'])})",
  ]
  if "per_device_bytes" in summary:
    fits = {None: "", True: "; fits", False: "; does NOT fit"}[summary["memory_fits"]]
    lines.append(
        f"per-device memory:          batch {summary['batch']} x {summary['seq']} on "
        f"{summary['mesh']} ({summary['memory_method']}): " + ", ".join(
            f"{key} {_human_bytes(value)}" for key, value in summary["per_device_bytes"].items())
        + fits)
  return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  if not FLAGS.gin_file:
    raise usage_error("--gin_file is required, e.g. --gin_file=configs/models/griffin_100m.gin")
  config = load_model_config(FLAGS.gin_file, FLAGS.gin_param)
  summary = summarize(config, FLAGS.seq, FLAGS.mesh, FLAGS.batch, FLAGS.device_memory_gb)
  print(json.dumps(summary, sort_keys=True) if FLAGS.json else format_text(summary))


if __name__ == "__main__":
  define_flags()
  cli.run(main)
