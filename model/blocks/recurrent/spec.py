"""The recurrent block's registry entry (Conv1D + RG-LRU, or the complex CG-LRU).

Hawk is made of it alone, Griffin mixes it with local attention. The layer is
`model.blocks.recurrent.layer.RecurrentBlock`; `ModelConfig.lru_variant` picks the real
RG-LRU or the complex CG-LRU (Griffin appendix B), which differ in the gates' output
width, the parameters of the recurrence and the transformers export (the RG-LRU only).
It declares every capability of `model.block_registry`: counting, memory terms
(calibrated against compiled peaks, see `model.memory`) and the transformers mapping.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import numpy as np

from model import partitioning as P
from model.block_registry import HFLeaf, ParamRole
from model.blocks.recurrent.layer import RecurrentBlock, RecurrentCache
from model.config import BlockType, ModelConfig
from model.scan import options as scan_options

# Training FLOP conventions of the recurrence (docs/model.md#training-flops).
RECURRENCE_FORWARD_FLOPS = 10     # per RG-LRU state element and token (model.counting)
RECURRENT_OUTPUT_GATE_FLOPS = 1   # x-branch ⊙ y-branch, per RG-LRU channel and token
# Activation buffers kept for the backward pass per token on TPU, x R/t (compute dtype,
# float32): compute dtype, the x and y projections, the Conv1D's output and the two gates'
# pre-activations (the bf16 pair `rg_lru` puts behind an optimization barrier); float32,
# the scan kernel's residuals, the decay a and the state h. The float32 gate chain
# (sigmoids, log a, the normaliser, the scaled input) is not kept: `rg_lru` recomputes it
# in the backward from the bf16 pre-activations (`jax.checkpoint`), so since 2bce3ec the
# two float32 sigmoids of (3, 4) became two bf16 pre-activations, and the scan no longer
# pads D_RNN = 2560 to 3072 channels. Read from libtpu's buffer assignment of
# griffin_1_3b cut to 3 layers, remat none, at the loss's backward (per recurrent layer,
# [4, 2048, 2560] per chip: the barrier's two bf16 gates, the kernel's f32 h and a, the
# Conv1D's and both projections' bf16 outputs); calibration: `model.memory`.
KEEP_RNN = (5, 2)
# The row for a scan lowered for any other platform (XLA:GPU, XLA:CPU): (3, 4), as
# calibrated before 2bce3ec and not refitted; no buffer assignment of those programs was
# read after it. XLA:GPU keeps more of the RG-LRU than either row (before 2bce3ec about
# 40 bytes per channel and token; hawk_1_3b without remat on 32 H100s compiled to
# 102.27 GiB per GPU after it, from 100.09), so the larger row is what holds the GPU
# records (benchmarks/RESULTS.md, "Against XLA:GPU").
KEEP_RNN_OFF_TPU = (3, 4)


class _RecurrentCounting:
  """The 6N weights and the element-wise recurrence work."""

  def matmul_params(self, config: ModelConfig) -> int:
    d, r = config.width, config.rnn_width
    gate_out = r // 2 if config.lru_variant == "complex" else r
    gates = 2 * r * gate_out // config.gate_blocks         # block-diagonal W_a, W_x
    return 3 * d * r + config.conv_width * r + gates       # W_x, W_y, W_out, Conv1D

  def mixing_flops(self, config: ModelConfig, seq_len: int) -> dict[str, float]:
    del seq_len
    forward = (RECURRENCE_FORWARD_FLOPS + RECURRENT_OUTPUT_GATE_FLOPS) * config.rnn_width
    return {"recurrence": 3.0 * forward}


class _RecurrentMemory:
  """Per-token terms of the analytic planner. Under remat "full" with the depth unrolled
  whole, libtpu schedules the recurrence's recomputation (gates, the scan kernel) of
  every unit ahead of the loss's backward, as it needs only the unit's saved input:
  `recomputed_ahead` (`model.memory`)."""
  recomputed_ahead = True

  def kept_activations(self, config: ModelConfig, seq: int, tensor: int
                       ) -> tuple[float, float, float]:
    del seq
    r = config.rnn_width
    # The TPU row only where the scan is lowered for TPU (the Pallas kernel's program;
    # no lowering platform named: this host's backend).
    keep = KEEP_RNN if scan_options.kernel_target(config.scan) == "tpu" else KEEP_RNN_OFF_TPU
    return keep[0] * r / tensor, keep[1] * r / tensor, 0.0

  def saved_matmul_outputs(self, config: ModelConfig, seq: int, tensor: int
                           ) -> tuple[float, float]:
    del seq
    return 3 * config.rnn_width / tensor + config.width, 0.0


class _RecurrentHFExport:
  """transformers' `temporal_block` of a recurrent RecurrentGemma layer."""

  def check(self, config: ModelConfig) -> None:
    if config.lru_variant != "real":
      raise ValueError("the complex CG-LRU has no transformers implementation (its "
                       "RecurrentGemma class has the real RG-LRU only)")

  def leaves(self) -> list[HFLeaf]:
    leaves = []
    for name in ("linear_x", "linear_y", "linear_out"):
      leaves += [(("recurrent_block", name, "kernel"), f"temporal_block.{name}.weight", True),
                 (("recurrent_block", name, "bias"), f"temporal_block.{name}.bias", False)]
    leaves += [(("recurrent_block", "conv_1d", "b"), "temporal_block.conv_1d.bias", False)]
    for ours, theirs in (("a_param", "recurrent_param"), ("input_gate/w", "input_gate_weight"),
                         ("input_gate/b", "input_gate_bias"),
                         ("a_gate/w", "recurrent_gate_weight"),
                         ("a_gate/b", "recurrent_gate_bias")):
      leaves.append((("recurrent_block", "rg_lru") + tuple(ours.split("/")),
                     f"temporal_block.rg_lru.{theirs}", False))
    return leaves

  def to_hf(self, layer: Mapping[str, Any]) -> dict[str, np.ndarray]:
    conv = np.asarray(layer["recurrent_block"]["conv_1d"]["w"])   # [W, R], oldest tap first
    return {"temporal_block.conv_1d.weight": conv.T[:, None, :]}

  def from_hf(self, take: Callable[[str], np.ndarray]) -> dict[tuple[str, ...], np.ndarray]:
    conv = take("temporal_block.conv_1d.weight")   # [R, 1, W]
    return {("recurrent_block", "conv_1d", "w"): conv[:, 0, :].T}


class RecurrentSpec:
  """Registry entry of "recurrent" (docs/model.md: the recurrent block)."""
  name = BlockType.RECURRENT.value
  title = "RG-LRU recurrent"
  layer = RecurrentBlock
  family = "hawk"
  logical_axes = (P.EMBED, P.RNN, P.RNN_HEADS, P.RNN_HEAD_DIM, P.CONV, P.BATCH, P.LENGTH,
                  P.ACT_RNN)
  counting = _RecurrentCounting()
  memory = _RecurrentMemory()
  hf_export = _RecurrentHFExport()
  # μP (docs/model.md): the gates are block-diagonal matrices whose blocks' fan-in
  # (D_RNN / H, H fixed) grows with width, so they are hidden; Λ, θ and the depthwise
  # Conv1D's taps act on each channel alone (fan-in W or 1), so they are vectors.
  param_roles = {
      "linear_x/kernel": ParamRole.HIDDEN, "linear_x/bias": ParamRole.VECTOR,
      "linear_y/kernel": ParamRole.HIDDEN, "linear_y/bias": ParamRole.VECTOR,
      "linear_out/kernel": ParamRole.HIDDEN, "linear_out/bias": ParamRole.VECTOR,
      "conv1d/kernel": ParamRole.VECTOR, "conv1d/bias": ParamRole.VECTOR,
      "rg_lru/input_gate/kernel": ParamRole.HIDDEN, "rg_lru/input_gate/bias": ParamRole.VECTOR,
      "rg_lru/a_gate/kernel": ParamRole.HIDDEN, "rg_lru/a_gate/bias": ParamRole.VECTOR,
      "rg_lru/a_param": ParamRole.VECTOR, "rg_lru/theta": ParamRole.VECTOR,
  }

  def validate(self, config: ModelConfig) -> None:
    del config  # the gate blocks and the CG-LRU's halves are checked for every model

  def init_cache(self, config: ModelConfig, batch_size: int, dtype: Any,
                 max_length: Optional[int]) -> RecurrentCache:
    del max_length  # constant-size state
    return RecurrentBlock.init_cache(config, batch_size, dtype)

  def param_count(self, config: ModelConfig) -> int:
    d, r = config.width, config.rnn_width
    if config.lru_variant == "complex":
      lru = 2 * (r // 2) + r // 2 + r // 2                 # gate biases, a_param, θ
    else:
      lru = 2 * r + r                                      # gate biases, a_param
    vectors = 2 * r + d + r + lru                          # W_x, W_y, W_out, conv biases
    return self.counting.matmul_params(config) + vectors
