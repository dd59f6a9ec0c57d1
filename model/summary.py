"""`python -m model.summary`: the size and cost of a model preset, without building it.

    python -m model.summary --gin_file=F [--gin_file=G ...] [--gin_param='a.b=1' ...]
        [--seq=T] [--json]
        [--mesh=data:2,fsdp:4,tensor:1 --batch=B [--device_memory_gb=G]]

Prints the total and non-embedding parameter counts, the training FLOPs per token at
sequence length T (DESIGN §4, see `model.counting`) and the decoding state per sequence.
With `--mesh`, also the per-device memory of training with a global batch of B rows of T
tokens (`model.memory.plan_memory`). With `--json` it prints one JSON object instead:
`params_total`, `params_non_embedding`, `params_embedding`, `flops_per_token`,
`flops_breakdown`, `seq`, `decode_state_bytes`, `model` (the resolved ModelConfig) and,
with a mesh, `per_device_bytes: {params, optimizer, gradients, activations, workspace,
total}` (total includes the optimizer update's workspace), `memory_fits` (null without
`--device_memory_gb`), `memory_method`, `mesh` and `batch`.

Everything is computed from shapes (`jax.eval_shape`), so the 14B presets take seconds.
Gin files may also bind trainer configurables this tool does not import; those bindings
are skipped. Bad input ends the program with one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, NoReturn, Optional, Sequence

DEFAULT_SEQ = 2048  # the Griffin paper's training length


class _UsageError(Exception):
  """Bad command-line input: reported as one line, never a traceback."""


class _ArgumentParser(argparse.ArgumentParser):
  def error(self, message: str) -> NoReturn:
    raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
  parser = _ArgumentParser(prog="python -m model.summary", description=__doc__.split("\n")[0])
  parser.add_argument("--gin_file", action="append", default=[], required=True,
                      help="Gin file binding ModelConfig (repeatable).")
  parser.add_argument("--gin_param", action="append", default=[],
                      help="Extra Gin binding, e.g. 'ModelConfig.depth = 6' (repeatable).")
  parser.add_argument("--seq", type=int, default=None,
                      help=f"Sequence length T for FLOPs and memory (default {DEFAULT_SEQ}).")
  parser.add_argument("--json", action="store_true", help="Print one JSON object.")
  parser.add_argument("--mesh", default=None,
                      help="Device mesh, e.g. 'data:2,fsdp:4,tensor:1': adds per-device memory.")
  parser.add_argument("--batch", type=int, default=None,
                      help="Global batch in sequences (with --mesh).")
  parser.add_argument("--device_memory_gb", type=float, default=None,
                      help="Device memory in GB to check the plan against (with --mesh).")
  return parser


def _one_line(error: BaseException) -> str:
  text = " ".join(str(error).split())
  return text or type(error).__name__


def load_model_config(gin_files: Sequence[str], gin_params: Sequence[str]) -> Any:
  """Parses the Gin files and bindings and returns the ModelConfig they describe."""
  import gin  # pylint: disable=import-outside-toplevel
  from model.config import ModelConfig  # pylint: disable=import-outside-toplevel

  for path in gin_files:
    if not os.path.isfile(path):
      raise _UsageError(f"--gin_file {path!r} does not exist")
  gin.clear_config()
  try:
    # Not finalized: the model's modules register configurables of their own on import.
    gin.parse_config_files_and_bindings(list(gin_files), list(gin_params),
                                        finalize_config=False, skip_unknown=True)
  except Exception as e:  # pylint: disable=broad-except; gin raises many kinds
    raise _UsageError(f"cannot parse the Gin configuration: {_one_line(e)}") from None
  try:
    return ModelConfig()
  except ValueError as e:  # gin appends "In call to configurable ...": keep the reason
    raise _UsageError(str(e).split("\n")[0]) from None


def summarize(config: Any, seq: int, mesh: Optional[str] = None, batch: Optional[int] = None,
              device_memory_gb: Optional[float] = None) -> dict[str, Any]:
  """The summary of `config` as a JSON-ready dict (see the module docstring)."""
  from model import counting  # pylint: disable=import-outside-toplevel

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
      "model": dataclasses.asdict(config),
  }
  if mesh is not None:
    result.update(_memory_plan(config, mesh, batch, seq, device_memory_gb))
  return result


def _memory_plan(config: Any, mesh: str, batch: Optional[int], seq: int,
                 device_memory_gb: Optional[float]) -> dict[str, Any]:
  """`model.memory.plan_memory` for the `--mesh` flag, trimmed to JSON-ready fields."""
  if batch is None:
    raise _UsageError("--mesh needs --batch (the global batch in sequences)")
  from model import memory  # pylint: disable=import-outside-toplevel
  from sharding.mesh import parse_mesh_flag  # pylint: disable=import-outside-toplevel
  plan = memory.plan_memory(config, parse_mesh_flag(mesh), batch, seq,
                            device_memory_gb=device_memory_gb)
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


def main(argv: Optional[Sequence[str]] = None) -> int:
  try:
    args = _parser().parse_args(argv)
    seq = DEFAULT_SEQ if args.seq is None else args.seq
    if seq < 1:
      raise _UsageError(f"--seq must be a positive integer, got {seq}")
    if args.batch is not None and args.batch < 1:
      raise _UsageError(f"--batch must be a positive integer, got {args.batch}")
    if args.mesh is None and (args.batch is not None or args.device_memory_gb is not None):
      raise _UsageError("--batch and --device_memory_gb need --mesh")
    config = load_model_config(args.gin_file, args.gin_param)
    summary = summarize(config, seq, args.mesh, args.batch, args.device_memory_gb)
  except _UsageError as e:
    print(f"model.summary: error: {e}", file=sys.stderr)
    return 2
  except ValueError as e:  # e.g. an invalid mesh, with the problem named
    print(f"model.summary: error: {_one_line(e)}", file=sys.stderr)
    return 2
  print(json.dumps(summary, sort_keys=True) if args.json else format_text(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
