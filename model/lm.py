"""The language model: tied embedding, a scanned stack of residual blocks, RMSNorm, logits.

    x = Embed(tokens) [· √D];  x = Block_l(x, positions) for l = 1..depth;
    logits = RMSNorm(x) · Eᵀ [· 1/m under μP]  [→ c · tanh(logits / c)]

Document boundaries come only from `positions` (each token's position in its document;
0 starts one): every temporal block derives what it needs from them, so packed rows work.

Depth is scanned. The repeating unit of `config.block_pattern` (R, R, A for Griffin) is one
module applied with `nn.scan` over `config.num_scanned_units`, its parameters stacked on a
leading `layers` axis; the trailing partial unit (`config.remainder_block_types`) follows
unscanned. Compile time and program size therefore do not grow with depth, except where
`config.depth_unroll` runs several units per loop iteration (by default the whole depth
of models of at most 12 layers, where the loop costs more step time than the unrolled
program costs compile time, and of any model on GPU without remat, where the loop makes
XLA:GPU keep every unit's residuals; see `ModelConfig.depth_scan_unroll`). Each unit is
rematerialised according to `config.remat` ("none", "full", or "save_matmuls": keep the
outputs of weight matmuls and recompute the rest).

Parameter tree (float32; `init_params` returns it unboxed). Layer l = u·P + j of a pattern
of length P lives at `blocks/block_{j}` index [u] when u < num_scanned_units, else at
`remainder_{j}`. For one Griffin unit (R, R, A) with D = width, R = rnn_width,
H = gate blocks (num_heads by default), N = num_heads, d = D/N, M = 3·D, W = conv_width,
every `blocks/...` leaf having an extra leading [num_scanned_units] axis:

    embedder/embedding                          [V, D]          (vocab, embed)
    blocks/block_0/temporal_norm/scale          [D]             (norm)
    blocks/block_0/recurrent/linear_x/kernel    [D, R]          (embed, rnn)
    blocks/block_0/recurrent/linear_x/bias      [R]             (rnn)
    blocks/block_0/recurrent/linear_y/kernel    [D, R]          (embed, rnn)
    blocks/block_0/recurrent/linear_y/bias      [R]             (rnn)
    blocks/block_0/recurrent/conv1d/kernel      [W, R]          (conv, rnn)  oldest tap first
    blocks/block_0/recurrent/conv1d/bias        [R]             (rnn)
    blocks/block_0/recurrent/rg_lru/a_param     [R]             (rnn)  a = exp(-8r softplus(.))
    blocks/block_0/recurrent/rg_lru/input_gate/kernel [H, R/H, R/H] (rnn_heads, rnn_head_dim, -)
    blocks/block_0/recurrent/rg_lru/input_gate/bias   [H, R/H]      (rnn_heads, rnn_head_dim)
    blocks/block_0/recurrent/rg_lru/a_gate/kernel     [H, R/H, R/H]
    blocks/block_0/recurrent/rg_lru/a_gate/bias       [H, R/H]
    blocks/block_0/recurrent/linear_out/kernel  [R, D]          (rnn, embed)
    blocks/block_0/recurrent/linear_out/bias    [D]             (embed)
    blocks/block_0/mlp_norm/scale               [D]             (norm)
    blocks/block_0/mlp/gate/kernel              [D, M]          (embed, mlp)
    blocks/block_0/mlp/gate/bias                [M]             (mlp)
    blocks/block_0/mlp/up/kernel                [D, M]          (embed, mlp)
    blocks/block_0/mlp/up/bias                  [M]             (mlp)
    blocks/block_0/mlp/down/kernel              [M, D]          (mlp, embed)
    blocks/block_0/mlp/down/bias                [D]             (embed)
    blocks/block_1/...                          as block_0
    blocks/block_2/temporal_norm/scale          [D]
    blocks/block_2/attention/q/kernel           [D, N·d]        (embed, q_heads)
    blocks/block_2/attention/k/kernel           [D, d]          (embed, kv)
    blocks/block_2/attention/v/kernel           [D, d]          (embed, kv)
    blocks/block_2/attention/out/kernel         [N·d, D]        (q_heads, embed)
    blocks/block_2/attention/out/bias           [D]             (embed)
    blocks/block_2/mlp_norm/scale, blocks/block_2/mlp/...       as block_0
    remainder_{j}/...                           as blocks/block_{j}, no leading axis
    final_norm/scale                            [D]             (norm)

The scanned leaves' logical axes start with `layers`. With the complex CG-LRU,
`rg_lru/a_param` is [R/2], the gates map R -> R/2 ([H, R/H, R/(2H)]) and
`rg_lru/theta` [R/2] (rnn) is added. A GateLoop layer holds `gateloop/...` in place of
`recurrent/...`. Relation to RecurrentGemma: its `ffw_up/w[0]`, `w[1]` are our `mlp/gate`,
`mlp/up` (bias `b[i, 0, 0]`), `proj_q/k/v/final` are `q/k/v/out`, `conv_1d/w, b` are
`conv1d/kernel, bias`, the RG-LRU gates' `w, b` are `kernel, bias`, `a_param` is
`a_param`, `input_embedding` is `embedding`; all other names match their modules.

Decoding cache (`model.decoding.init_cache`): {"blocks": tuple over the pattern of caches
stacked on a leading [num_scanned_units] axis, "remainder": tuple of unstacked caches}.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import partitioning as P
from model.config import ModelConfig
from model.embedder import Embedder, readout
from model.norms import RMSNorm
from model.residual_block import ResidualBlock

REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole unit in the backward pass
    "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class RepeatingUnit(nn.Module):
  """One repetition of the block pattern; the body of the depth scan.

  Attributes:
    config: the model.
    return_cache: build and return the blocks' decoding caches (static).
  """
  config: ModelConfig
  return_cache: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, segment_pos: jax.Array, cache: Any
               ) -> tuple[jax.Array, Optional[tuple]]:
    new_cache = []
    for j, block_type in enumerate(self.config.block_pattern):
      x, block_cache = ResidualBlock(self.config, block_type, name=f"block_{j}")(
          x, segment_pos, None if cache is None else cache[j], self.return_cache)
      new_cache.append(block_cache)
    return x, (tuple(new_cache) if self.return_cache else None)


def _scanned_units(config: ModelConfig) -> type[nn.Module]:
  """`RepeatingUnit` rematerialised per `config.remat` and scanned over depth."""
  unit = RepeatingUnit
  if config.remat != "none":
    unit = nn.remat(unit, policy=REMAT_POLICIES[config.remat], prevent_cse=False)
  return nn.scan(
      unit,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast, 0),
      length=config.num_scanned_units,
      unroll=config.depth_unroll,
      metadata_params={nn.PARTITION_NAME: P.LAYERS})


class LanguageModel(nn.Module):
  """Griffin / Hawk / MQA / GateLoop language model (see the module docstring)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, positions: jax.Array, cache: Optional[dict] = None,
               return_cache: bool = False, return_hidden: bool = False
               ) -> tuple[jax.Array, Optional[dict]]:
    """tokens, positions int32 [B, T] -> (float32 logits [B, T, V], cache or None).

    Args:
      tokens: token ids.
      positions: each token's position in its document; 0 starts a document.
      cache: decoding cache from `model.decoding.init_cache` or a previous call; the
        tokens continue the sequence it holds.
      return_cache: also return the updated cache (prefill and decode steps).
      return_hidden: return the final normalised states [B, T, D] (compute dtype) in
        place of the logits, for a loss that forms the logits in chunks
        (`output_logits`; `pretrain.losses`).
    """
    cfg = self.config
    embedder = Embedder(cfg, name="embedder")
    x = P.constrain(embedder.encode(tokens), (P.BATCH, P.LENGTH, P.ACT_EMBED))
    new_cache = {"blocks": (), "remainder": ()}
    if cfg.num_scanned_units:
      units = _scanned_units(cfg)(cfg, return_cache, name="blocks")
      x, unit_cache = units(x, positions, None if cache is None else cache["blocks"])
      new_cache["blocks"] = unit_cache
    tail_cache = []
    for j, block_type in enumerate(cfg.remainder_block_types):
      x, block_cache = ResidualBlock(cfg, block_type, name=f"remainder_{j}")(
          x, positions, None if cache is None else cache["remainder"][j], return_cache)
      tail_cache.append(block_cache)
    new_cache["remainder"] = tuple(tail_cache)
    x = RMSNorm(cfg.dtype, name="final_norm")(x)
    if return_hidden:
      return x, (new_cache if return_cache else None)
    logits = output_logits(cfg, embedder.embedding, x)
    return logits, (new_cache if return_cache else None)


def output_logits(config: ModelConfig, embedding: jax.Array, x: jax.Array) -> jax.Array:
  """Final normalised states [B, T, D] -> float32 logits [B, T, V] (tied, times μP's
  output multiplier, soft-capped)."""
  logits = readout(config, x, embedding)
  if config.logits_soft_cap is not None:
    cap = config.logits_soft_cap
    logits = jnp.tanh(logits / cap) * cap
  return P.constrain(logits, (P.BATCH, P.LENGTH, P.ACT_VOCAB))


def _dummy_inputs() -> tuple[jax.Array, jax.Array]:
  return jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32)


@functools.lru_cache(maxsize=16)
def _compiled_init(config: ModelConfig):
  """One jitted initialiser per config, so repeated initialisations compile once."""
  return jax.jit(lambda rng: nn.meta.unbox(
      LanguageModel(config).init(rng, *_dummy_inputs())["params"]))


def init_params(config: ModelConfig, rng: jax.Array) -> Any:
  """Freshly initialised float32 parameters (plain arrays, no partitioning boxes)."""
  return _compiled_init(config)(rng)


def param_logical_axes(config: ModelConfig) -> Any:
  """PartitionSpecs of logical axis names, structured like `init_params`'s result.

  Computed from shapes only (`jax.eval_shape`): nothing is allocated, so it is cheap for
  any model size.
  """
  return abstract_params_and_axes(config)[1]


def abstract_params_and_axes(config: ModelConfig) -> tuple[Any, Any]:
  """(`jax.ShapeDtypeStruct`s of `init_params`'s result, `param_logical_axes`) from one
  abstract initialisation, for callers that need both."""
  abstract = jax.eval_shape(LanguageModel(config).init, jax.random.PRNGKey(0),
                            *_dummy_inputs())
  return nn.meta.unbox(abstract)["params"], nn.get_partition_spec(abstract)["params"]
