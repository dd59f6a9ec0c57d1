"""The GateLoop block's registry entry (data-controlled complex transitions).

The layer is `model.blocks.gateloop.layer.GateLoopBlock`. It declares counting and
memory terms (the memory terms not calibrated against a compiled peak, see
`model.memory`); transformers has no GateLoop, so it declares no export.
"""
from __future__ import annotations

from typing import Any, Optional

import jax

from model import partitioning as P
from model.block_registry import ParamRole
from model.blocks.gateloop.layer import GateLoopBlock
from model.config import BlockType, ModelConfig

# Complex multiply-add (8) + real readout q·Re(h) (2), per state element and token.
GATELOOP_FORWARD_FLOPS = 10


class _GateLoopCounting:
  """The 6N weights and the complex recurrence's work."""

  def matmul_params(self, config: ModelConfig) -> int:
    d = config.width
    transitions = 0 if config.gateloop_fixed_transitions else 2 * d * d
    return 4 * d * d + transitions                         # q, k, v, out (+ γ, θ)

  def mixing_flops(self, config: ModelConfig, seq_len: int) -> dict[str, float]:
    del seq_len
    forward = GATELOOP_FORWARD_FLOPS * config.width * config.gateloop_head_dim
    return {"recurrence": 3.0 * forward}


class _GateLoopMemory:
  """Per-token terms of the analytic planner."""

  def kept_activations(self, config: ModelConfig, seq: int, tensor: int
                       ) -> tuple[float, float, float]:
    del seq
    return 3 * config.width / tensor, 12 * config.width / tensor, 0.0

  def saved_matmul_outputs(self, config: ModelConfig, seq: int, tensor: int
                           ) -> tuple[float, float]:
    del seq
    return 3 * config.width / tensor + config.width, 0.0


class GateLoopSpec:
  """Registry entry of "gateloop" (docs/model.md: GateLoop)."""
  name = BlockType.GATELOOP.value
  title = "GateLoop"
  layer = GateLoopBlock
  family = "gateloop"
  logical_axes = (P.EMBED, P.RNN, P.BATCH, P.LENGTH, P.ACT_RNN)
  counting = _GateLoopCounting()
  memory = _GateLoopMemory()
  # μP (docs/model.md): the D x D projections are hidden; the transitions' biases and
  # the ablation's fixed transitions are per state row, so they are vectors.
  param_roles = {
      "query/kernel": ParamRole.HIDDEN, "key/kernel": ParamRole.HIDDEN,
      "value/kernel": ParamRole.HIDDEN, "output/kernel": ParamRole.HIDDEN,
      "magnitude/kernel": ParamRole.HIDDEN, "magnitude/bias": ParamRole.VECTOR,
      "phase/kernel": ParamRole.HIDDEN, "phase/bias": ParamRole.VECTOR,
      "fixed_magnitude": ParamRole.VECTOR, "fixed_phase": ParamRole.VECTOR,
  }

  def validate(self, config: ModelConfig) -> None:
    if config.width % config.gateloop_head_dim:
      raise ValueError(f"ModelConfig.width={config.width} must be divisible by "
                       f"gateloop_head_dim={config.gateloop_head_dim}")

  def init_cache(self, config: ModelConfig, batch_size: int, dtype: Any,
                 max_length: Optional[int]) -> jax.Array:
    del max_length  # constant-size state
    return GateLoopBlock.init_cache(config, batch_size, dtype)

  def param_count(self, config: ModelConfig) -> int:
    return self.counting.matmul_params(config) + 2 * config.width   # γ, θ biases or values
