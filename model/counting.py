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

Each block type states its own terms (matmul and vector parameters, the attention or
recurrence FLOPs) in its registry entry (`model.block_registry`, built-ins in
`model.blocks`); this module adds them up.

S̄(T) is the mean number of keys a query attends to in a row of T tokens, counted
exactly for the causal mask: min(t + 1, W + 1) keys at position t for a local window W
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
(2) per state element. These terms are below 0.1% of the total at paper sizes.

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

# The conventions above, used by the blocks' registry entries (`model.blocks`).
RECURRENCE_FORWARD_FLOPS = 10     # per RG-LRU state element and token, see above
RECURRENT_OUTPUT_GATE_FLOPS = 1   # x-branch ⊙ y-branch, per RG-LRU channel and token
GATELOOP_FORWARD_FLOPS = 10       # complex multiply-add (8) + real readout (2)


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
  """Weights of one temporal-mixing block that multiply each token once."""
  return block_registry.get(block).matmul_params(config)


def _block_vector_params(config: ModelConfig, block: str) -> int:
  """Biases, norm scales and per-channel parameters of one temporal-mixing block."""
  return block_registry.get(block).vector_params(config)


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
  vectors = sum(_block_vector_params(config, block) + _mlp_vector_params(config)
                + 2 * config.width                         # the block's two RMSNorms
                for block in config.block_types)
  embedding = embedding_param_count(config)
  total = analytic_matmul_params(config) + vectors + config.width + embedding  # final norm
  return ParamCounts(total=total, embedding=embedding)


# -- FLOPs -------------------------------------------------------------------------------
def mean_attended_keys(window: Optional[int], seq_len: int) -> float:
  """Mean keys per query under the causal (and local-window) mask, T tokens per row."""
  t = np.arange(seq_len, dtype=np.float64)
  keys = t + 1 if window is None else np.minimum(t + 1, window + 1)
  return float(keys.mean())


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
    for term, flops in block_registry.get(block).mixing_flops(config, seq_len).items():
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
