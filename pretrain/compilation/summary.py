r"""A model's parameters, FLOPs and (with a mesh) memory plan from its Gin config: the
library of `python -m pretrain.summary`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from model import counting
from model import memory
from model.blocks.attention import fused
from model.config import ModelConfig, model_config_to_dict
from plumbing.errors import usage_error
from pretrain import gin_config
from pretrain.compilation import memory_plan
from sharding.mesh import parse_mesh_flag


DEFAULT_SEQ = 2048  # the Griffin paper's training length


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
      "flops_estimated": counting.undeclared_counting(config),
      "model": model_config_to_dict(config),
      "attention": attention_by_platform(config, seq, mesh),
  }
  if mesh is not None:
    result.update(_memory_plan(config, mesh, batch, seq, device_memory_gb))
  return result


def attention_by_platform(config: ModelConfig, seq: int, mesh: Optional[str]
                          ) -> Optional[dict[str, dict[str, str]]]:
  """{"tpu" | "gpu" | "cpu": {"impl", "reason"}}: what training calls of `seq` tokens run
  on each platform under the config's `AttentionOptions` and the mesh (a `sequence` axis
  of size > 1 splits time); None for a model without attention."""
  if "attention" not in config.block_types:
    return None
  split = None
  if mesh is not None and parse_mesh_flag(mesh).get("sequence", 1) > 1:
    split = "sequence"
  result = {}
  for platform in ("tpu", "gpu", "cpu"):
    target = dataclasses.replace(config.scan, lowering_platform=platform)
    choice = fused.choose(config.attention, target, config.attention_window, seq, split)
    result[platform] = {"impl": choice.impl, "reason": choice.reason}
  return result


def _memory_plan(config: ModelConfig, mesh: str, batch: Optional[int], seq: int,
                 device_memory_gb: Optional[float]) -> dict[str, Any]:
  """`pretrain.compilation.memory_plan.plan_memory` for the `--mesh` flag, trimmed to JSON-ready fields."""
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
          "memory_estimated": plan.get("estimated", []), "mesh": plan.get("mesh"),
          "batch": batch}


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
  if summary.get("attention"):
    lines.append(f"attention at T={summary['seq']}:    " + "; ".join(
        f"{platform.upper()} {choice['impl']}" + (f" ({choice['reason']})" if choice["reason"]
                                                  else "")
        for platform, choice in summary["attention"].items()))
  if "per_device_bytes" in summary:
    fits = {None: "", True: "; fits", False: "; does NOT fit"}[summary["memory_fits"]]
    lines.append(
        f"per-device memory:          batch {summary['batch']} x {summary['seq']} on "
        f"{summary['mesh']} ({summary['memory_method']}): " + ", ".join(
            f"{key} {_human_bytes(value)}" for key, value in summary["per_device_bytes"].items())
        + fits)
  if summary["flops_estimated"]:
    lines.append(f"  estimated: block types {', '.join(map(repr, summary['flops_estimated']))}"
                 " declare no counting (BlockSpec.counting); their FLOPs are 6 x their "
                 "parameters, no attention or recurrence term (model.counting)")
  if summary.get("memory_estimated"):
    lines.append(memory.estimate_line(summary["memory_estimated"]))
  return "\n".join(lines)
