"""The attention a compiled step runs, and the cost of the kernel launches XLA cannot see.

`attention_plan` says which implementation the trainer's step uses for attention on
the target (the layer's own `training_choice`, evaluated on the target's mesh), with
the reason where it is XLA's path. `declared_kernel_costs` counts the splash attention
launches in the compiled program (one forward per attention layer and call, a dq and
a dkv per backward; remat recomputes count again) and prices each with
`model.blocks.attention.kernel_costs`, whose figures come from the kernel's block
arithmetic. Their roofline time (FLOPs at the chip's peak or bytes at its HBM
bandwidth, whichever is longer) is added to XLA's estimate, which counts those custom
calls' operand bytes but no FLOPs; the report keeps both parts apart and labels them.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional

import jax.numpy as jnp

from model import partitioning as P
from model.blocks.attention import fused
from model.blocks.attention import kernel_costs
from model.blocks.attention.layer import training_choice
from model.config import ModelConfig

# A splash launch's instruction in compiled HLO text: "%splash_mqa_fwd_... = (...)
# custom-call(" (the kernel names itself after its kind).
_SPLASH_LAUNCH = re.compile(r"%splash_mqa_(fwd|dq|dkv)\S* = .*custom-call\(")


@dataclasses.dataclass(frozen=True)
class DeclaredCosts:
  """The fused-attention launches of a compiled step and what they cost one device.

  Attributes:
    launches: {"fwd" | "dq" | "dkv": launches in the program}.
    flops, transcendentals, bytes: summed over those launches.
    seconds: their roofline time on the target (None without peak figures).
  """
  launches: dict[str, int]
  flops: float
  transcendentals: float
  bytes: float
  seconds: Optional[float]


def attention_plan(config: ModelConfig, sequence_length: int) -> Optional[dict[str, str]]:
  """{"impl", "reason"} of the step's training calls on the mesh in scope (the
  runtime's activation context); None for a model without attention blocks."""
  if "attention" not in config.block_types:
    return None
  choice = training_choice(config, sequence_length)
  return {"impl": choice.impl, "reason": choice.reason}


def _shards(spec_entry: Any, mesh: Any) -> int:
  return math.prod(mesh.shape[name] for name in P.mesh_axis_names(spec_entry))


def declared_kernel_costs(hlo_text: str, config: ModelConfig, rows: int,
                          sequence_length: int, peak_flops: Optional[float],
                          hbm_bandwidth: Optional[float]) -> Optional[DeclaredCosts]:
  """The splash launches of `hlo_text` priced for one device; None when there are none.

  Called in the runtime's activation context, so the queries' layout gives each
  device's rows and heads. `rows` is the global batch rows of one call (one
  microbatch).
  """
  launches = {kind: 0 for kind in ("fwd", "dq", "dkv")}
  for match in _SPLASH_LAUNCH.finditer(hlo_text):
    launches[match.group(1)] += 1
  if not any(launches.values()):
    return None
  shape = (rows, sequence_length, config.num_heads, config.head_dim)
  layout = P.shard_layout(shape, (P.BATCH, P.LENGTH, P.ACT_HEADS, None))
  row_shards = heads_shards = 1
  if layout is not None:
    row_shards = _shards(layout.spec[0], layout.mesh)
    heads_shards = _shards(layout.spec[2], layout.mesh)
  options = config.attention
  per_launch = kernel_costs.splash_launch_costs(
      rows // row_shards, config.num_heads // heads_shards, sequence_length,
      config.head_dim, config.attention_window,
      fused.kernel_block(options.block_q, sequence_length),
      fused.kernel_block(options.block_kv, sequence_length),
      jnp.dtype(config.dtype).itemsize)
  total = lambda field: sum(getattr(per_launch[k], field) * n for k, n in launches.items())
  seconds = None
  if peak_flops and hbm_bandwidth:
    seconds = sum(n * max(per_launch[k].flops / peak_flops,
                          per_launch[k].bytes / hbm_bandwidth)
                  for k, n in launches.items())
  return DeclaredCosts(launches, total("flops"), total("transcendentals"), total("bytes"),
                       seconds)
