"""GateLoop: a linear recurrence whose complex state transitions are data-controlled.

GateLoop (Katsch 2023, §3-4) generalises linear recurrent layers (S4, LRU, RetNet) by
letting the *transition* itself, not only the input and output gates, depend on the
token.  Per head, with real projections of the block input x_n:

  q_n, k_n, v_n = W_q x_n, W_k x_n, W_v x_n                (each d_h wide)
  a_n = sigmoid(W_gamma x_n + b_gamma) * exp(i (W_theta x_n + b_theta))   (d_h wide)
  H_n = diag(a_n) H_{n-1} + k_n v_n^T                        (complex d_h x d_h)
  y_n = Re(q_n^T H_n)                                       (d_h wide)

and an output projection of the concatenated heads.  The magnitude goes through a
sigmoid (the paper's choice over LRU's exp(-exp(.)), which is biased towards 1), the phase
has no activation.  With the default max-headed variant (head size d_h = 1, as in the
paper's experiments) the state is one complex number per channel and the recurrence is
element-wise.  With d_h > 1 the transition scales the *key* rows of the outer-product
state (so a head may forget per key dimension); the paper writes the right product
H a_n with a diagonal a_n, which for d_h = 1 is the same thing.

`gateloop_fixed_transitions=True` is the paper's ablation (§5.1, fig. 6): the
transition is a learned parameter per state row, the same at every step (RetNet-like),
so the layer cannot decide to forget at a reset token.

Documents are independent: at a document start (segment position 0) the transition is
0, which empties the state before the new token's k v^T enters it.

The recurrence runs on the shared engine (`model.recurrence.mesh_aware_linear_scan`, so a
sequence mesh splits it over shards) with complex64 inputs;
the decoding cache is the complex state itself, so a model decodes one token at a time
in constant memory.
"""
from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import partitioning as P
from model import recurrence
from model.config import ModelConfig

# Initial state-transition magnitude sigmoid(b_gamma) is drawn uniformly from this range
# (per state row), so that at initialisation memories decay over ~10..1000 tokens, the
# same spread as the RG-LRU's base decay (docs/model.md).  The phase bias starts small.
_INIT_MAGNITUDE_RANGE = (0.9, 0.999)
_INIT_MAX_PHASE = math.pi / 10


def _magnitude_bias_init(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
  """Logits whose sigmoid is uniform in `_INIT_MAGNITUDE_RANGE`."""
  low, high = _INIT_MAGNITUDE_RANGE
  magnitude = jax.random.uniform(key, shape, jnp.float32, low, high)
  return (jnp.log(magnitude) - jnp.log1p(-magnitude)).astype(dtype)


def _phase_bias_init(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
  return jax.random.uniform(key, shape, jnp.float32, 0.0, _INIT_MAX_PHASE).astype(dtype)


def complex_transition(log_magnitude_logits: jax.Array, phase: jax.Array) -> jax.Array:
  """a = sigmoid(gamma) * exp(i theta), computed as exp(log_sigmoid(gamma) + i theta).

  The log-space form keeps a tiny magnitude (a strong "forget") accurate instead of
  rounding sigmoid(gamma) to 0 and losing its gradient.
  """
  log_magnitude = jax.nn.log_sigmoid(log_magnitude_logits.astype(jnp.float32))
  return jnp.exp(jax.lax.complex(log_magnitude, phase.astype(jnp.float32)))


class GateLoopBlock(nn.Module):
  """GateLoop temporal-mixing block: [B, T, D] -> [B, T, D].

  Attributes:
    config: the model description; uses `width`, `gateloop_head_dim`,
      `gateloop_fixed_transitions`, `depth` (output init scale), `dtype`, `scan_impl` and
      `scan`.
  """
  config: ModelConfig

  @property
  def num_heads(self) -> int:
    return self.config.width // self.config.gateloop_head_dim

  @staticmethod
  def state_size(config: ModelConfig) -> int:
    """Complex numbers of recurrent state per sequence: heads x d_h x d_h = D x d_h."""
    return config.width * config.gateloop_head_dim

  @staticmethod
  def init_cache(config: ModelConfig, batch_size: int, dtype=None) -> jax.Array:
    """An empty decoding cache: the zero complex64 state [batch_size, D * d_h].

    `dtype` is accepted for the uniform block interface but the state always
    accumulates in complex64, whatever the compute dtype.
    """
    del dtype
    return jnp.zeros((batch_size, GateLoopBlock.state_size(config)), jnp.complex64)

  def _dense(self, name: str, features: int, in_axis: str, out_axis: str,
             kernel_init: nn.initializers.Initializer, use_bias: bool = False,
             bias_init: nn.initializers.Initializer = nn.initializers.zeros) -> nn.Dense:
    return nn.Dense(
        features, use_bias=use_bias, name=name,
        dtype=jnp.dtype(self.config.dtype), param_dtype=jnp.float32,
        kernel_init=nn.with_logical_partitioning(kernel_init, (in_axis, out_axis)),
        bias_init=nn.with_logical_partitioning(bias_init, (out_axis,)))

  def _transition(self, x: jax.Array) -> jax.Array:
    """Complex transitions a [B, T, D] (one per state row), before document resets."""
    width = self.config.width
    if self.config.gateloop_fixed_transitions:
      gamma = self.param("fixed_magnitude",
                         nn.with_logical_partitioning(_magnitude_bias_init, ("rnn",)),
                         (width,), jnp.float32)
      theta = self.param("fixed_phase",
                         nn.with_logical_partitioning(_phase_bias_init, ("rnn",)),
                         (width,), jnp.float32)
      gamma = jnp.broadcast_to(gamma, x.shape[:2] + (width,))
      theta = jnp.broadcast_to(theta, x.shape[:2] + (width,))
    else:
      lecun = nn.initializers.lecun_normal()
      gamma = self._dense("magnitude", width, "embed", "rnn", lecun, use_bias=True,
                          bias_init=_magnitude_bias_init)(x)
      theta = self._dense("phase", width, "embed", "rnn", lecun, use_bias=True,
                          bias_init=_phase_bias_init)(x)
    return complex_transition(gamma, theta)

  @nn.compact
  def __call__(self, x: jax.Array, segment_pos: jax.Array,
               cache: Optional[jax.Array] = None,
               return_cache: bool = False) -> tuple[jax.Array, Optional[jax.Array]]:
    """Mixes along time.

    Args:
      x: [B, T, D] block input (already normalised by the residual block).
      segment_pos: int [B, T] position of each token within its document; 0 resets.
      cache: optional complex64 [B, D * d_h] state carried from earlier tokens.
      return_cache: whether to return the state after the last token.

    Returns:
      (y [B, T, D] in the compute dtype, the new cache or None).
    """
    config = self.config
    batch, length, width = x.shape
    if width != config.width:
      raise ValueError(f"GateLoopBlock got inputs of width {width}, but "
                       f"ModelConfig.width is {config.width}")
    heads, head_dim = self.num_heads, config.gateloop_head_dim
    dtype = jnp.dtype(config.dtype)
    x = x.astype(dtype)

    lecun = nn.initializers.lecun_normal()
    q = self._dense("query", width, "embed", "rnn", lecun)(x)
    k = self._dense("key", width, "embed", "rnn", lecun)(x)
    v = self._dense("value", width, "embed", "rnn", lecun)(x)
    q, k, v = (P.constrain(t, (P.BATCH, P.LENGTH, P.ACT_RNN)) for t in (q, k, v))

    a = self._transition(x)
    a = jnp.where((segment_pos == 0)[..., None], jnp.zeros_like(a), a)

    # Per head: state rows follow the key dimension i, columns the value dimension j.
    k = k.astype(jnp.float32).reshape(batch, length, heads, head_dim, 1)
    v = v.astype(jnp.float32).reshape(batch, length, heads, 1, head_dim)
    kv = (k * v).reshape(batch, length, heads * head_dim * head_dim)
    a = jnp.broadcast_to(a.reshape(batch, length, heads, head_dim, 1),
                         (batch, length, heads, head_dim, head_dim))
    a = a.reshape(batch, length, heads * head_dim * head_dim)

    state, last_state = recurrence.mesh_aware_linear_scan(
        a, kv.astype(jnp.complex64), cache, impl=config.scan_impl, options=config.scan)

    # Real q and real projection weights (paper appendix C): Re(q^T H) = q^T Re(H).
    state = jnp.real(state).reshape(batch, length, heads, head_dim, head_dim)
    q = q.astype(jnp.float32).reshape(batch, length, heads, head_dim)
    y = jnp.einsum("bthi,bthij->bthj", q, state).reshape(batch, length, width)

    out_init = nn.initializers.variance_scaling(2.0 / config.depth, "fan_in", "normal")
    y = self._dense("output", width, "rnn", "embed", out_init)(y.astype(dtype))
    return y, (last_state if return_cache else None)

