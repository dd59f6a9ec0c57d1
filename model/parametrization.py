"""The maximal update parametrisation (μP) of every model here, and the standard one.

Under the standard parametrisation the best learning rate drifts with width, so every
size of a study needs its own probes. μP (Yang & Hu 2021; Yang et al. 2022, "Tensor
Programs V", whose Adam table this follows) scales initialisation, per-parameter Adam
learning rates and a few forward multipliers with the width multiplier

    m = ModelConfig.width / ModelConfig.mup_base_width

so that every layer's output and the logits move by Θ(1) per step at any width: a rate
tuned on the proxy of width `mup_base_width` holds for the wide model. At m = 1 μP is
the standard parametrisation exactly, so the proxy is an ordinary model.

Every parameter has a role (`ParamRole`; the blocks declare theirs in their registry
entry, `param_roles`, and this module declares the language model's own):

    role    parameters                         init                 Adam LR   forward
    input   the tied embedding E [V, D]        std 1/√D_base        × 1       × √D_base in place
                                               (standard: 1/√D)               of × √D (only with
                                                                              embeddings_scale_by_sqrt_dim)
    output  the tied readout (the same E)      (E's)                (E's)     logits × 1/m
    hidden  every matrix whose fan-in grows    unchanged: var c /   × 1/m     × 1
            with width (projections, MLP,      fan-in, c as in the
            attention, the RG-LRU's block-     standard init
            diagonal gates, GateLoop's)
    vector  biases, norm scales, Λ (a_param),  unchanged            × 1       × 1
            θ, Conv1D taps, GateLoop's fixed
            transitions

and attention scores are q·k · √d_base / d instead of q·k / √d (d the head dimension,
d_base = d / m the proxy's): the 1/d of μP, equal to the standard scale at m = 1. It is
applied as a multiplier 1/√m on the queries, which the export folds into W_q.

The width convention: the proxy is this model with the same number of heads and
RG-LRU gate blocks and every width (D, D_RNN, the MLP's, the head dimension, the gate
blocks') divided by m, so every hidden matrix's fan-in is m times the proxy's and one
multiplier serves them all. docs/model.md ("μP") gives the reasoning for the roles that
are not obvious (the block-diagonal gates, Λ, the depthwise Conv1D) and the coordinate
check that supports them (benchmarks/mup_coord_check.py, tests/test_mup.py).
"""
from __future__ import annotations

from typing import Any, Optional

import jax

from model import block_registry
from model.block_registry import ParamRole
from model.config import ModelConfig

# The language model's own parameters (outside the temporal blocks), by path.
_MODEL_ROLES = {"embedder/embedding": ParamRole.INPUT, "final_norm/scale": ParamRole.VECTOR}
# Those of every residual block, by path inside it (`model.residual_block`, `model.mlp`).
_RESIDUAL_ROLES = {
    "temporal_norm/scale": ParamRole.VECTOR, "mlp_norm/scale": ParamRole.VECTOR,
    "mlp/gate/kernel": ParamRole.HIDDEN, "mlp/gate/bias": ParamRole.VECTOR,
    "mlp/up/kernel": ParamRole.HIDDEN, "mlp/up/bias": ParamRole.VECTOR,
    "mlp/down/kernel": ParamRole.HIDDEN, "mlp/down/bias": ParamRole.VECTOR,
}


def is_mup(config: ModelConfig) -> bool:
  return config.parametrization == "mup"


def width_multiplier(config: ModelConfig) -> float:
  """m = width / mup_base_width under μP; 1 under the standard parametrisation."""
  return config.width / config.mup_base_width if is_mup(config) else 1.0


def embedding_init_std(config: ModelConfig) -> float:
  """The embedding's init std: 1/√D, or 1/√D_base under μP (input-like: fixed in width)."""
  return (config.mup_base_width if is_mup(config) else config.width) ** -0.5


def input_scale_width(config: ModelConfig) -> int:
  """The width whose (bfloat16) √ multiplies the embedding when
  `embeddings_scale_by_sqrt_dim` is set: D, or D_base under μP (a constant in width)."""
  return config.mup_base_width if is_mup(config) else config.width


def logit_multiplier(config: ModelConfig) -> Optional[float]:
  """1/m on the tied readout's logits under μP; None (no multiply at all) otherwise."""
  return 1.0 / width_multiplier(config) if is_mup(config) else None


def query_multiplier(config: ModelConfig) -> Optional[float]:
  """1/√m on the attention queries under μP, turning the scores' 1/√d into √d_base/d;
  None (no multiply at all) otherwise."""
  return width_multiplier(config) ** -0.5 if is_mup(config) else None


def _names(path: tuple[Any, ...]) -> tuple[str, ...]:
  return tuple(jax.tree_util.keystr((key,), simple=True) for key in path)


def param_role(config: ModelConfig, names: tuple[str, ...]) -> ParamRole:
  """The role of the parameter at `names` (path components) of `init_params`'s tree.

  Raises:
    ValueError: a block's parameter has no declared role (names the block and it), or
      the path is not one of the language model's.
  """
  joined = "/".join(names)
  if joined in _MODEL_ROLES:
    return _MODEL_ROLES[joined]
  if names[0] == "blocks" and len(names) > 2:
    inside = names[2:]                    # blocks/block_{j}/...
  elif names[0].startswith("remainder_") and len(names) > 1:
    inside = names[1:]                    # remainder_{j}/...
  else:
    raise ValueError(f"parameter {joined!r} is not one μP knows (model.parametrization)")
  inside_path = "/".join(inside)
  if inside_path in _RESIDUAL_ROLES:
    return _RESIDUAL_ROLES[inside_path]
  block = block_registry.get(inside[0])
  roles = block.param_roles or {}
  own = "/".join(inside[1:])
  if own not in roles:
    raise ValueError(f"μP: block type {block.name!r} declares no role for its parameter "
                     f"{own!r}; add it to param_roles in the block's registry entry "
                     "(hidden or vector: docs/model.md, μP)")
  return roles[own]


def param_roles(config: ModelConfig, params: Any) -> Any:
  """A tree like `params` (arrays or ShapeDtypeStructs) of each leaf's `ParamRole`."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: param_role(config, _names(path)), params)


def learning_rate_multipliers(config: ModelConfig, params: Any) -> Optional[Any]:
  """A tree like `params` of each parameter's Adam learning-rate multiplier (1/m for
  hidden matrices, 1 for the rest) under μP; None under the standard parametrisation,
  whose optimizer has no per-parameter scaling at all (`pretrain.optimizer`).

  Raises:
    ValueError: as `param_role`.
  """
  if not is_mup(config):
    return None
  hidden = 1.0 / width_multiplier(config)
  return jax.tree.map(lambda role: hidden if role == ParamRole.HIDDEN else 1.0,
                      param_roles(config, params))
