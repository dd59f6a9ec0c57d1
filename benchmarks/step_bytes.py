r"""Where a compiled train step's HBM bytes go: XLA:TPU's program, broken down by model part.

  python benchmarks/step_bytes.py --topology=v5p-8 --gin_file=configs/models/griffin_400m.gin \
      --mesh=data:4 --gin_param=BATCH_SIZE=16 --gin_param=SEQUENCE_LENGTH=2048 \
      --gin_param=ModelConfig.depth=3 [--top=15] [--json=PATH] [--hlo=PATH]

`cost_analysis()` gives one total of bytes accessed. To see which part of the model
moves them (issue: Griffin and Hawk moved 26-35% more bytes than MQA at 100M), this
compiles the trainer's step (`pretrain.compile.compile_from_gin`, the depth unrolled and
the loss in one chunk so every layer is a top-level instruction) and reads the
optimized program: every instruction of the entry computation that moves data (a
fusion, a copy, a Pallas custom call, a collective, ...) reads its operands and writes
its result, so its bytes are the sizes of the arrays on its line. The instruction's
`op_name` metadata (the JAX name stack: `jvp(...)` forward, `transpose(jvp(...))`
backward, the Flax module path) says which pass and which part it belongs to. The sum is
an upper bound on XLA's own figure (a fusion that reads a slice of an operand is charged
the whole operand here), printed beside it.
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import collections
import json
import re
import sys
from typing import Iterable, Sequence

import jax
from absl import flags

from plumbing import cli
from pretrain import compile as compile_lib

FLAGS = flags.FLAGS

# Instructions that move no HBM bytes of their own (views, bookkeeping, or the second
# half of an async pair whose start is charged).
_NO_TRAFFIC = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
               "after-all", "partition-id", "replica-id", "iota", "copy-done",
               "slice-done", "all-reduce-done", "all-gather-done",
               "collective-permute-done", "async-done", "send-done", "recv-done",
               "opt-barrier"}
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
          "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
          "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_BYTES, key=len, reverse=True))
                    + r")\[([\d,]*)\](?:\{([^}]*)\})?")
_TILE = re.compile(r"T\(([\d,]+)\)")
# `%name = <result shape> opcode(%operand, ...), attributes`
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
# Arrays in another memory space than HBM (S(1): VMEM on TPU) move no HBM bytes.
_MEMORY_SPACE = re.compile(r"S\(\d+\)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_BLOCK = re.compile(r"/blocks/block_\d+/")


def array_bytes(text: str) -> float:
  """HBM bytes of every array written in `text` (`bf16[16,2048,1024]{2,1,0:T(8,128)(2,1)}`;
  one in another memory space, `S(1)`, counts nothing),
  as laid out: XLA:TPU pads the dimensions its first tile covers (the most minor ones,
  in the layout's minor-to-major order) to whole tiles, which at small widths is most
  of the array."""
  total = 0.0
  for dtype, dims, layout in _ARRAY.findall(text):
    sizes = [int(d) for d in dims.split(",") if d]
    minor_to_major, _, tiling = layout.partition(":")
    if _MEMORY_SPACE.search(tiling):
      continue
    tile = _TILE.search(tiling)
    if tile and sizes:
      order = [int(d) for d in minor_to_major.split(",") if d] or list(
          reversed(range(len(sizes))))
      for dim, tile_size in zip(order, reversed([int(t) for t in tile.group(1).split(",")])):
        sizes[dim] = -(-sizes[dim] // tile_size) * tile_size
    count = 1
    for size in sizes:
      count *= size
    total += count * _BYTES[dtype]
  return total


def entry_instructions(hlo_text: str) -> Iterable[str]:
  """The instruction lines of the program's entry computation. It ends at a line that is
  only its closing brace: a Pallas launch's metadata may spread JSON over lines that
  start with one (splash attention's does)."""
  inside = False
  for line in hlo_text.splitlines():
    if line.startswith("ENTRY "):
      inside = True
    elif inside and line.rstrip() == "}":
      return
    elif inside and line.strip():
      yield line


def part_of(op_name: str) -> tuple[str, str]:
  """(pass, part) of an instruction from its JAX name stack."""
  step = ("backward" if "transpose(jvp(" in op_name
          else "forward" if "jvp(" in op_name else "optimizer and rest")
  block = _BLOCK.search(op_name)
  if block:
    path = [p for p in op_name[block.end():].split("/")
            if p and not p.startswith(("jit(", "jvp(", "transpose(", "closed_call",
                                       "shard_map", "while", "body", "remat"))]
    # The last element is the primitive; einsum specs name no module.
    modules = [p for p in path[:-1] if "->" not in p and "," not in p]
    return step, "block/" + "/".join(modules[:2]) if modules else "block/(glue)"
  for part in ("embedder", "final_norm", "btd,vd->btv"):
    if part in op_name:
      return step, {"btd,vd->btv": "logits"}.get(part, part)
  return step, "loss, optimizer, other"


# JAX's splash attention names its launches (`splash_mqa_fwd_...`, `..._dq_...`,
# `..._dkv_...`) and carries no JAX name stack: charged to attention by that name.
_SPLASH = "splash_mqa_"


def splash_part(name: str) -> tuple[str, str]:
  """(pass, part) of a splash attention launch, from its instruction name."""
  return ("forward" if name.startswith(_SPLASH + "fwd") else "backward",
          "block/attention (splash kernel)")


def breakdown(hlo_text: str) -> dict[tuple[str, str], dict[str, float]]:
  """{(pass, part): {"bytes": ..., "instructions": ...}} of the entry computation: each
  instruction that moves data is charged its HBM result and its operands' HBM results,
  each once (a tiled matmul that reads an operand again per tile is charged it once:
  XLA's own figure counts those re-reads, so it is the larger)."""
  results: dict[str, float] = {}
  totals: dict[tuple[str, str], dict[str, float]] = collections.defaultdict(
      lambda: {"bytes": 0.0, "instructions": 0})
  for line in entry_instructions(hlo_text):
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, result, opcode, rest = match.groups()
    results[name] = array_bytes(result)
    if opcode in _NO_TRAFFIC:
      continue
    # Operands end where the attributes begin (`), kind=`, `), calls=`, ...).
    operands = _OPERAND.findall(rest.split("), ", 1)[0])
    moved = sum(results.get(operand, 0.0) for operand in operands)
    if opcode != "copy-start":  # its result aliases its operand and a VMEM buffer
      moved += results[name]
    op_name = _OP_NAME.search(line)
    key = (splash_part(name) if name.startswith(_SPLASH) else
           part_of(op_name.group(1).split(";")[0] if op_name else ""))
    totals[key]["bytes"] += moved
    totals[key]["instructions"] += 1
  return dict(totals)


def format_table(totals: dict[tuple[str, str], dict[str, float]], tokens_per_chip: float,
                 xla_bytes: float | None, top: int) -> str:
  whole = sum(v["bytes"] for v in totals.values())
  rows = sorted(totals.items(), key=lambda item: -item[1]["bytes"])
  lines = ["| pass | part | GB | share | bytes per token | instructions |",
           "|---|---|---|---|---|---|"]
  for (step, part), value in rows[:top]:
    lines.append(f"| {step} | {part} | {value['bytes'] / 1e9:.3f} | "
                 f"{100 * value['bytes'] / whole:.1f}% | "
                 f"{value['bytes'] / tokens_per_chip:,.0f} | {value['instructions']:.0f} |")
  rest = rows[top:]
  if rest:
    lines.append(f"| (the other {len(rest)}) | | {sum(v['bytes'] for _, v in rest) / 1e9:.3f} "
                 f"| | | |")
  lines.append(f"\nSum over instructions: {whole / 1e9:.3f} GB per chip"
               + (f"; XLA's bytes accessed: {xla_bytes / 1e9:.3f} GB" if xla_bytes else ""))
  return "\n".join(lines)


def define_flags() -> None:
  cli.define_gin_flags()
  flags.DEFINE_string("topology", "v5p-8", "TPU slice (pretrain.compile --topology).")
  flags.DEFINE_string("mesh", "data:4", "Mesh over the slice's chips.")
  flags.DEFINE_integer("top", 20, "Rows shown (largest first).")
  flags.DEFINE_string("json", None, "Also write the breakdown here.")
  flags.DEFINE_string("hlo", None, "Also write the compiled program's text here.")


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  jax.config.update("jax_platforms", "cpu")  # the target's compiler only; no TPU runtime
  params = list(FLAGS.gin_param) + ["TrainConfig.loss_chunks=1"]
  depth = next((p.split("=", 1)[1] for p in params if p.startswith("ModelConfig.depth=")),
               None)
  if depth:
    params.append(f"ModelConfig.depth_scan_unroll={depth}")
  report, compiled = compile_lib.compile_from_gin(FLAGS.topology, 1, FLAGS.gin_file, params,
                                                  FLAGS.mesh)
  if report.while_loops:
    print(f"warning: {report.while_loops} while loop(s) in the program; their bodies are "
          "charged once (set ModelConfig.depth to unroll)", file=sys.stderr)
  hlo_text = compiled.as_text()
  if FLAGS.hlo:
    with open(FLAGS.hlo, "w", encoding="utf-8") as f:
      f.write(hlo_text)
  totals = breakdown(hlo_text)
  tokens_per_chip = report.tokens / report.devices
  print(format_table(totals, tokens_per_chip, report.bytes_accessed, FLAGS.top))
  if FLAGS.json:
    with open(FLAGS.json, "w", encoding="utf-8") as f:
      json.dump({"report": report.as_dict(),
                 "parts": [{"pass": s, "part": p, **v} for (s, p), v in totals.items()]},
                f, indent=1)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
