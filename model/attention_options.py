"""`AttentionOptions`: which implementation computes a training call's attention.

A property of the machine, like `model.scan.ScanOptions`: models carry one in
`ModelConfig.attention`, checkpoints leave it out, and entry points build it from Gin
(`AttentionOptions.impl = "splash"`). Below the layer and the fused kernels, which both
need it, so it imports nothing of the model (and sits outside `model.blocks`, whose
package registers the blocks, which import `model.config`, which holds these options).

Implementations (`impl`):
- "xla": the masked softmax(QKᵀ)V of `model.blocks.attention.layer`, float32 scores
  in memory. The reference, the CPU path, and every call with a decoding cache.
- "splash": JAX's TPU splash attention (Pallas / Mosaic): MQA, causal or sliding-window
  mask, document masks as segment ids, masked blocks skipped; scores never leave VMEM.
- "triton": JAX's Pallas GPU flash attention (Triton): causal with document masks as
  segment ids, the single K/V head broadcast to the query heads. It has no
  sliding-window mask, so it serves global attention only; local attention on a GPU
  runs the XLA path (blocked, 2·w·T scores), and the plan says so.
- "auto": the fused kernel of the target platform where this project's tests built it
  with that platform's own compiler (splash on TPU; Triton on the NVIDIA generations
  of the Pallas scan's verified list, global attention only), else "xla"
  (`model.blocks.attention.fused.choose`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

IMPLS = ("auto", "xla", "splash", "triton")


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """Tunables of the attention implementations (Gin: `AttentionOptions.impl = "xla"`).

  Attributes:
    impl: "auto", "xla", "splash" or "triton" (module docstring).
    block_q: query rows per kernel block (forward and backward). A sequence that is
      not a multiple of it uses the largest multiple of 128 that divides it, or one
      block when it is shorter than 128; a sequence with neither runs "xla".
    block_kv: key rows per kernel block, chosen the same way.
    interpret: run the Pallas kernels in interpret mode; None = exactly when the
      target platform is CPU (tests compare them with "xla" there).
  """
  impl: str = "auto"
  block_q: int = 512
  block_kv: int = 512
  interpret: Optional[bool] = None

  def __post_init__(self):
    if self.impl not in IMPLS:
      raise ValueError(f"AttentionOptions.impl must be one of {IMPLS}, got {self.impl!r}.")
    for name in ("block_q", "block_kv"):
      value = getattr(self, name)
      if value < 128 or value % 128:
        raise ValueError(f"AttentionOptions.{name} must be a multiple of 128 (the TPU's "
                         f"lane width), got {value}.")
