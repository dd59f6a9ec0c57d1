"""Real-Gated Linear Recurrent Unit (RG-LRU) and its complex variant (CG-LRU).

RG-LRU, per channel and element-wise (Griffin §2.4):

    r_t = σ(W_a x_t + b_a)                     recurrence gate
    i_t = σ(W_x x_t + b_x)                     input gate
    log a_t = -c · r_t · softplus(a_param)     c = 8, so a_t = σ(Λ)^(c r_t) with Λ = -a_param
    h_t = a_t ⊙ h_{t-1} + sqrt(1 - a_t²) ⊙ (i_t ⊙ x_t),   y_t = h_t.

W_a and W_x are block-diagonal with `config.gate_blocks` blocks ([blocks, C/blocks,
C/blocks] kernels, leading axis `rnn_heads`), so sharding heads over `tensor` needs no
communication. a_t is formed in log space and a_t² as exp(2 log a_t), which stays exact
where a_t is within float32 epsilon of 1; the coefficients are always computed in float32
(bf16 cannot even represent σ(Λ) = 0.999). The gradient of the square root is clipped at
1000 (it is infinite at a_t = 1) to keep bf16 training stable. At a document start
(segment_pos == 0) the state resets: a_t = 0 and the normaliser is 1.

CG-LRU (`lru_variant="complex"`, Griffin appendix B): the C input channels are the real
and imaginary halves of C/2 complex channels; the gates have C/2 outputs and

    a_t = exp(-c r_t softplus(a_param) + i · θ ⊙ r_t),   sqrt(1 - |a_t|²) as above,

with θ learnable (initialised uniform in [0, 0.1π]). The recurrence runs as complex64 on
the same engine and the output is [Re h ‖ Im h].

Λ is initialised so that σ(Λ) (the base decay) has its square uniform on
[0.9², 0.999²], i.e. uniform in area on a ring, as RecurrentGemma does.

Sequence parallelism: when the mesh in scope splits time, the recurrence runs as a scan
over shards (see `model.recurrence.mesh_aware_linear_scan`); the gates are per-token and need no communication.
"""
from __future__ import annotations

import functools
import itertools
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import partitioning as P
from model import recurrence
from model.config import ModelConfig

GATE_EXPONENT = 8.0
MAX_SQRT_GRADIENT = 1000.0
MIN_RADIUS, MAX_RADIUS = 0.9, 0.999
MAX_THETA = 0.1 * jnp.pi


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def sqrt_bounded_gradient(x: jax.Array, max_gradient: float) -> jax.Array:
  """sqrt(x) whose derivative is capped at `max_gradient` (evaluated at max(x, 1/(4 g²)))."""
  del max_gradient
  return jnp.sqrt(x)


def _sqrt_fwd(x, max_gradient):
  del max_gradient
  return jnp.sqrt(x), x


def _sqrt_bwd(max_gradient, x, g):
  clipped = jnp.maximum(x, 1.0 / (4.0 * max_gradient ** 2))
  return (g * 0.5 * jax.lax.rsqrt(clipped),)


sqrt_bounded_gradient.defvjp(_sqrt_fwd, _sqrt_bwd)


def ring_init(min_radius: float = MIN_RADIUS, max_radius: float = MAX_RADIUS):
  """Init of a_param such that exp(-softplus(a_param)) has its square uniform on the ring."""
  def init(key, shape, dtype=jnp.float32):
    u = jax.random.uniform(key, shape, jnp.float32)
    log_radius = 0.5 * jnp.log(u * (max_radius ** 2 - min_radius ** 2) + min_radius ** 2 + 1e-8)
    return jnp.log(jnp.exp(-log_radius) - 1.0).astype(dtype)  # inverse softplus of -log r
  return init


def theta_init(key, shape, dtype=jnp.float32):
  return (MAX_THETA * jax.random.uniform(key, shape, jnp.float32)).astype(dtype)


class BlockDiagonalLinear(nn.Module):
  """y = blockdiag(W_1..W_H) x + b, H = `num_blocks`; one block per head.

  Kernels [H, in/H, out/H] are LeCun-normal over the full input width (variance 1/in), as
  in RecurrentGemma.
  """
  num_blocks: int
  features: int
  dtype: Any = jnp.float32

  @nn.compact
  def weights(self, in_features: int) -> tuple[jax.Array, jax.Array]:
    """The float32 (kernel [H, in/H, out/H], bias [H, out/H]), declared on first use."""
    blocks = self.num_blocks
    block_in, block_out = in_features // blocks, self.features // blocks
    # Not nn.initializers.lecun_normal: it truncates; RecurrentGemma's normal does not.
    kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal",
                                                   in_axis=(0, 1), out_axis=2)
    kernel = P.logical_param(self, "kernel", kernel_init, (blocks, block_in, block_out),
                             (P.RNN_HEADS, P.RNN_HEAD_DIM, None))
    bias = P.logical_param(self, "bias", nn.initializers.zeros_init(), (blocks, block_out),
                           (P.RNN_HEADS, P.RNN_HEAD_DIM))
    return kernel, bias

  def __call__(self, x: jax.Array) -> jax.Array:
    (y,) = block_diagonal(x, [self.weights(x.shape[-1])], self.dtype)
    return y


# The gates' input [B, T, C] (the Conv1D's output).
_GATE_INPUT_LAYOUT = (P.BATCH, P.LENGTH, P.ACT_RNN)


def block_diagonal(x: jax.Array, weights: Sequence[tuple[jax.Array, jax.Array]],
                   dtype: Any) -> list[jax.Array]:
  """[blockdiag(W) x + b for (W, b) in `weights`] (kernels [H, in/H, out_k/H], biases
  [H, out_k/H]) as one batched matmul in `dtype`: the kernels are concatenated along
  their outputs, so x is read once and one transposed matmul gives every input
  gradient.

  On TPU the per-head matmul comes out time-minor (XLA lays [heads, B, out, T] out so
  that 160-wide heads need no lane padding); the kernel is broadcast over the batch so
  that batch is a batch dimension of the matmul as well, which makes that layout
  [B, heads, out, T], the bytes of a time-minor [B, T, out] (a bitcast), instead of a
  heads-major one that cost an extra copy of each gate forward and of the input
  gradient backward (benchmarks/RESULTS.md, "RG-LRU layout"). The products and sums
  are the same. Not where the mesh splits time: there the partitioner would sum each
  row's kernel gradient over the time shards before summing over the batch, a
  collective B times the size of the kernel's.
  """
  blocks = weights[0][0].shape[0]
  widths = [kernel.shape[-1] for kernel, _ in weights]
  x = x.astype(dtype).reshape(*x.shape[:-1], blocks, x.shape[-1] // blocks)
  kernel = jnp.concatenate([k for k, _ in weights], axis=-1).astype(dtype)
  bias = jnp.concatenate([b for _, b in weights], axis=-1).astype(dtype)
  if x.ndim == 4 and P.sequence_sharding(x.shape[1], _GATE_INPUT_LAYOUT) is None:
    kernel = jnp.broadcast_to(kernel, (x.shape[0], *kernel.shape))
    y = jnp.einsum("bthi,bhio->btho", x, kernel) + bias
  else:
    y = jnp.einsum("...hi,hio->...ho", x, kernel) + bias
  outs = jnp.split(y, list(itertools.accumulate(widths[:-1])), axis=-1)
  return [out.reshape(*out.shape[:-2], out.shape[-2] * out.shape[-1]) for out in outs]


def _coefficients(gate_x, gate_a, x, segment_pos, a_param, theta, *, is_complex):
  """(a, x') of the scan h_t = a_t h_{t-1} + x'_t from the gates' pre-activations."""
  gate_x = jax.nn.sigmoid(gate_x.astype(jnp.float32))
  gate_a = jax.nn.sigmoid(gate_a.astype(jnp.float32))
  log_a = -GATE_EXPONENT * gate_a * jax.nn.softplus(a_param)
  reset = (segment_pos == 0)[..., None]
  normaliser = sqrt_bounded_gradient(1.0 - jnp.exp(2.0 * log_a), MAX_SQRT_GRADIENT)
  normaliser = jnp.where(reset, 1.0, normaliser)
  x = x.astype(jnp.float32)
  if is_complex:
    a = jnp.exp(jax.lax.complex(log_a, theta * gate_a))
    real, imag = jnp.split(x, 2, axis=-1)
    x = jax.lax.complex(real, imag)
  else:
    a = jnp.exp(log_a)
  a = jnp.where(reset, jnp.zeros_like(a), a)
  return a, x * gate_x * normaliser


class RGLRU(nn.Module):
  """The RG-LRU (real) or CG-LRU (complex) recurrence over D_RNN channels."""
  config: ModelConfig

  @property
  def is_complex(self) -> bool:
    return self.config.lru_variant == "complex"

  @nn.compact
  def __call__(self, x: jax.Array, segment_pos: jax.Array, cache: Optional[jax.Array] = None,
               return_cache: bool = False) -> tuple[jax.Array, Optional[jax.Array]]:
    """x [B, T, C], segment_pos [B, T], cache h0 ([B, C] f32, or [B, C/2] c64) -> (y, h_T)."""
    cfg = self.config
    channels = x.shape[-1]
    state_width = channels // 2 if self.is_complex else channels
    a_param = P.logical_param(self, "a_param", ring_init(), (state_width,), (P.RNN,))
    weights = [BlockDiagonalLinear(cfg.gate_blocks, state_width, cfg.dtype, name=name
                                   ).weights(channels) for name in ("input_gate", "a_gate")]
    gate_x, gate_a = block_diagonal(x, weights, cfg.dtype)
    theta = (P.logical_param(self, "theta", theta_init, (state_width,), (P.RNN,))
             if self.is_complex else None)
    # The gates stay in the compute dtype between the matmul and the float32 maths: XLA
    # would otherwise fuse the sigmoids into the (time-minor) matmul and move float32
    # gates through two relayout copies each into [B, T, C]. The float32 maths is
    # recomputed in the backward from these (prevent_cse=False lets XLA reuse the
    # forward's [B, T, C] copies) rather than kept as float32 residuals
    # (benchmarks/RESULTS.md, "RG-LRU layout").
    gate_x, gate_a = jax.lax.optimization_barrier((gate_x, gate_a))
    coefficients = jax.checkpoint(
        functools.partial(_coefficients, is_complex=self.is_complex), prevent_cse=False)
    a, x = coefficients(gate_x, gate_a, x, segment_pos, a_param, theta)
    h, h_last = recurrence.mesh_aware_linear_scan(a, x, cache,
                                                  impl=cfg.scan_impl, options=cfg.scan)
    if self.is_complex:
      h = jnp.concatenate([jnp.real(h), jnp.imag(h)], axis=-1)
    h = P.constrain(h.astype(cfg.dtype), (P.BATCH, P.LENGTH, P.ACT_RNN))
    return h, (h_last if return_cache else None)

  @staticmethod
  def init_cache(config: ModelConfig, batch_size: int) -> jax.Array:
    """Zero state: float32 [B, D_RNN], or complex64 [B, D_RNN/2] for the CG-LRU."""
    if config.lru_variant == "complex":
      return jnp.zeros((batch_size, config.rnn_width // 2), jnp.complex64)
    return jnp.zeros((batch_size, config.rnn_width), jnp.float32)
