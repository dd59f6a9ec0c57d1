"""Parameter counts, training FLOPs per token and decode-state bytes of a `ModelConfig`.

Everything here is shape arithmetic: the parameter tree is obtained with `jax.eval_shape`
of the model's initialiser, so a 14B model is counted without allocating a byte of it.

Parameters. `count_params` counts the real tree; `analytic_matmul_params` restates the
same architecture by hand (docs/model.md#parameter-counts) so a test can hold one against the other.

Training FLOPs per token (docs/model.md#training-flops), with the usual "6N" convention
(forward 2 FLOPs per weight per token, backward twice that):

    6 · N_matmul                           every weight that multiplies each token once
                                           (dense kernels, block-diagonal RG-LRU gates,
                                           the depthwise Conv1D taps); the embedding
                                           lookup is free
  + 6 · D · V                              the tied output projection
  + 12 · D · S̄(T) per attention layer     scores q·k and the weighted sum of values,
                                           4·D FLOPs per attended key forward
  + 3 · F_rec · state per recurrent layer  element-wise recurrence work

Each block type states its own terms in its registry entry (`model.block_registry`,
built-ins in `model/blocks/<name>/spec.py`): its parameter count, and, as its optional
`counting` capability, which of those parameters are matmul weights and its attention
or recurrence FLOPs; this module adds them up. A block that declares no `counting`
(a research block with only its layer and parameter count) counts every parameter as a
weight that multiplies each token once, so its FLOPs are 6 · param_count per token,
exact for a block of bias-free dense kernels and an upper bound of its weights' work
otherwise; work beyond the weights (attention scores, element-wise recurrences) it
counts as none until it declares `mixing_flops`. `undeclared_counting` names such
blocks.

S̄(T) (`model.blocks.attention.spec.mean_attended_keys`) is the mean number of keys a
query attends to in a row of T tokens, counted exactly for the causal mask: min(t + 1, W + 1) keys at position t for a local window W
(keys t-W..t, as in the reference), t + 1 for global attention, so global attention
costs (T + 1)/2 keys per query: the "halved for causality" count. It measures the work
the maths needs; a kernel that evaluates the masked-out half (dense T x T scores) does
more, which is why XLA's count of such a forward is larger (see tests/test_counting.py).

F_rec = 10 FLOPs per state element per token forward: the RG-LRU's log-space decay
(-c · r · softplus(Λ): 2), a² = exp(2 log a) (1), 1 - a² (1), the gated and normalised
input i ⊙ x · sqrt(·) (2), the document reset of a and of the normaliser (2) and the
scan's multiply-add (2); transcendentals (σ, exp, sqrt) count as zero, as in MFU
conventions. The gating of the recurrent branch's output by GeLU(W_y x) adds 1 more per
RG-LRU channel. GateLoop counts its complex multiply-add (8) and the real readout q·Re(h)
(2) per state element. These terms are below 0.1% of the total at paper sizes; their
constants live with the blocks (`model.blocks.recurrent.spec`, `model.blocks.gateloop.spec`).

Decode state (bytes per sequence): what `model.decoding.init_cache` allocates for one
sequence: the RG-LRU state (float32), the Conv1D's last conv_width - 1 inputs (compute
dtype), the ring-buffer KV cache of one K/V head (compute dtype) of the local window, or
of `max_length` tokens for global attention, plus the cache's int32 bookkeeping.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import numpy as np

from model import block_registry
from model.config import ModelConfig
from model import lm
from model import residual_block


@dataclasses.dataclass(frozen=True)
class ParamCounts:
  """Number of parameters, split by role."""
  total: int
  embedding: int

  @property
  def non_embedding(self) -> int:
    return self.total - self.embedding


def param_shapes(config: ModelConfig) -> Any:
  """The model's parameter tree as `jax.ShapeDtypeStruct`s (nothing is allocated)."""
  return _param_shapes(config)


@functools.lru_cache(maxsize=32)
def _param_shapes(config: ModelConfig) -> Any:
  return jax.eval_shape(lambda: lm.init_params(config, jax.random.PRNGKey(0)))


def embedding_param_count(config: ModelConfig) -> int:
  """The tied embedding table: V · D."""
  return config.vocab_size * config.width


def count_params(config: ModelConfig) -> ParamCounts:
  """Counts the parameters of the model's real tree (via `jax.eval_shape`)."""
  leaves = jax.tree_util.tree_leaves(param_shapes(config))
  total = sum(math.prod(leaf.shape) for leaf in leaves)
  return ParamCounts(total=int(total), embedding=embedding_param_count(config))


# -- the architecture restated by hand -------------------------------------------------
def block_matmul_params(config: ModelConfig, block: str) -> int:
  """Weights of one temporal-mixing block that multiply each token once: its declared
  `counting.matmul_params`, else all its parameters (module docstring)."""
  declared = block_registry.get(block).counting
  if declared is None:
    return block_registry.get(block).param_count(config)
  return declared.matmul_params(config)


def undeclared_counting(config: ModelConfig) -> list[str]:
  """The block types of `config` whose FLOPs are 6 · param_count by default, having
  declared no `counting` (no attention or recurrence term is counted for them)."""
  return [block for block in dict.fromkeys(config.block_pattern)
          if block_registry.get(block).counting is None]


def mlp_matmul_params(config: ModelConfig) -> int:
  return 3 * config.width * config.mlp_width               # gate, up, down


def _mlp_vector_params(config: ModelConfig) -> int:
  return 2 * config.mlp_width + config.width               # their biases


def analytic_matmul_params(config: ModelConfig) -> int:
  """Matmul-like weights of all residual blocks (excludes the embedding)."""
  return sum(block_matmul_params(config, block) + mlp_matmul_params(config)
             for block in config.block_types)


def analytic_param_counts(config: ModelConfig) -> ParamCounts:
  """The parameter count by hand: matmul weights, vectors, norms and the embedding."""
  blocks = sum(block_registry.get(block).param_count(config) + mlp_matmul_params(config)
               + _mlp_vector_params(config) + 2 * config.width   # the block's two RMSNorms
               for block in config.block_types)
  embedding = embedding_param_count(config)
  total = blocks + config.width + embedding                       # final norm
  return ParamCounts(total=total, embedding=embedding)


# -- FLOPs -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FlopsBreakdown:
  """Training FLOPs per token, by term (see the module docstring)."""
  matmul: float
  output_projection: float
  attention: float
  recurrence: float

  @property
  def total(self) -> float:
    return self.matmul + self.output_projection + self.attention + self.recurrence


def training_flops_breakdown(config: ModelConfig, seq_len: int) -> FlopsBreakdown:
  """Training (forward + backward) FLOPs per token for rows of `seq_len` tokens."""
  if seq_len < 1:
    raise ValueError(f"seq_len must be >= 1, got {seq_len}")
  mixing = dict.fromkeys(block_registry.FLOP_TERMS, 0.0)
  for block, layers in block_registry.count_by_type(config.block_types).items():
    declared = block_registry.get(block).counting
    terms = {} if declared is None else declared.mixing_flops(config, seq_len)
    for term, flops in terms.items():
      if term not in mixing:
        raise ValueError(f"block type {block!r} counts FLOPs as {term!r}; the terms are "
                         f"{block_registry.FLOP_TERMS}")
      mixing[term] += layers * flops
  return FlopsBreakdown(
      matmul=6.0 * analytic_matmul_params(config),
      output_projection=6.0 * config.width * config.vocab_size, **mixing)


def training_flops_per_token(config: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token (docs/model.md#training-flops), the numerator of MFU."""
  return training_flops_breakdown(config, seq_len).total


# -- decoding state ----------------------------------------------------------------------
def decode_state_bytes(config: ModelConfig, max_length: Optional[int] = None) -> int:
  """Bytes of the decoding cache of one sequence (global attention needs `max_length`).

  Sums, over the residual blocks, the shapes of each block's empty cache as the model
  builds it (`model.residual_block.init_block_cache`, what `model.decoding.init_cache`
  stacks over the scanned depth), so this follows the implementation exactly.
  """
  total = 0
  for block in set(config.block_types):
    cache = jax.eval_shape(lambda b=block: residual_block.init_block_cache(
        config, b, 1, config.dtype, max_length))
    block_bytes = sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
                      for leaf in jax.tree_util.tree_leaves(cache))
    total += block_bytes * config.block_types.count(block)
  return int(total)
