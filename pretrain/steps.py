"""The jitted step functions: train (accumulate, then apply) and eval.

As in T5X, a train step is two halves. `accumulate_gradients` runs the model over the
microbatches of one batch (a `lax.scan`) and returns summed gradients and loss sums, so
the result is exactly the big batch's; `apply_gradients` normalises them by the token
count, runs the optimizer and reports the step's metrics. The state is donated, so
parameters and optimizer state are updated in place.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax

from model.lm import LanguageModel
from pretrain.losses import loss_sums
from pretrain.runtime import BATCH_FEATURES, Runtime

SUM_NAMES = ("nll_sum", "z_sum", "weight_sum")


class TrainState(NamedTuple):
  """Everything the jitted step updates. `step` counts completed updates."""
  step: jax.Array
  params: Any
  opt_state: Any


def split_microbatches(batch: Mapping[str, jax.Array], count: int) -> dict[str, jax.Array]:
  """[B, ...] -> [count, B/count, ...], microbatch m taking rows m, m+count, ...

  Interleaved rows keep each device's rows spread evenly over microbatches, so the
  batch sharding of the leading axis survives the split without communication.
  """
  def split(x):
    rows = x.shape[0]
    return jnp.swapaxes(x.reshape((rows // count, count) + x.shape[1:]), 0, 1)
  return {name: split(x) for name, x in batch.items()}


def accumulate_gradients(model: LanguageModel, params: Any, batch: Mapping[str, jax.Array],
                         microbatches: int = 1, z_loss_weight: float = 0.0,
                         loss_chunks: int = 1) -> tuple[Any, dict[str, jax.Array]]:
  """Summed gradients and loss sums {nll_sum, z_sum, weight_sum} over the batch."""
  grad_fn = jax.grad(lambda p, b: loss_sums(model, p, b, z_loss_weight, loss_chunks),
                     has_aux=True)
  if microbatches == 1:
    return grad_fn(params, batch)

  def accumulate(carry, micro):
    grads_acc, sums_acc = carry
    grads, sums = grad_fn(params, micro)
    return (jax.tree.map(jnp.add, grads_acc, grads),
            jax.tree.map(jnp.add, sums_acc, sums)), None

  zeros = (jax.tree.map(jnp.zeros_like, params),
           {name: jnp.zeros((), jnp.float32) for name in SUM_NAMES})
  (grads, sums), _ = jax.lax.scan(accumulate, zeros,
                                  split_microbatches(batch, microbatches))
  return grads, sums


def apply_gradients(state: TrainState, grad_sums: Any, sums: Mapping[str, jax.Array],
                    optimizer: optax.GradientTransformation, schedule: optax.Schedule
                    ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update from summed gradients; returns the new state and metrics."""
  total_weight = jnp.maximum(sums["weight_sum"], 1.0)
  grads = jax.tree.map(lambda g: g / total_weight, grad_sums)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {
      "loss": sums["nll_sum"] / total_weight,
      "z_loss": sums["z_sum"] / total_weight,
      "grad_norm": optax.tree.norm(grads),
      "param_norm": optax.tree.norm(params),
      "learning_rate": schedule(state.step),
      "tokens": sums["weight_sum"],
  }
  return TrainState(state.step + 1, params, opt_state), metrics


def make_train_step(model: LanguageModel, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, microbatches: int = 1,
                    z_loss_weight: float = 0.0, loss_chunks: int = 1) -> Callable:
  """The un-jitted step: (state, batch) -> (new state, metrics of this step)."""
  def step(state: TrainState, batch: Mapping[str, jax.Array]):
    grads, sums = accumulate_gradients(model, state.params, batch, microbatches,
                                       z_loss_weight, loss_chunks)
    return apply_gradients(state, grads, sums, optimizer, schedule)
  return step


class TrainStepProgram(NamedTuple):
  """The jitted train step over a runtime's mesh, and the layout of what it updates.

  Attributes:
    step: jit((state, batch) -> (new state, metrics)), state donated.
    state_shardings: TrainState of shardings (step replicated, params and optimizer
      state in the runtime's layout).
    abstract_state: TrainState of ShapeDtypeStructs carrying those shardings.
  """
  step: Callable
  state_shardings: TrainState
  abstract_state: TrainState


def jit_train_step(runtime: Runtime, optimizer: optax.GradientTransformation,
                   schedule: optax.Schedule, microbatches: int = 1,
                   z_loss_weight: float = 0.0, loss_chunks: int = 1) -> TrainStepProgram:
  """The train step exactly as the trainer runs it (and `pretrain.compile` compiles it)."""
  abstract_opt_state, opt_shardings = runtime.opt_state_layout(optimizer)
  state_shardings = TrainState(runtime.replicated, runtime.param_shardings, opt_shardings)
  step = jax.jit(make_train_step(runtime.model, optimizer, schedule, microbatches,
                                 z_loss_weight, loss_chunks),
                 in_shardings=(state_shardings, runtime.batch_shardings()),
                 out_shardings=(state_shardings, runtime.replicated),
                 donate_argnums=(0,))
  abstract_state = TrainState(
      jax.ShapeDtypeStruct((), jnp.int32, sharding=runtime.replicated),
      runtime.abstract_params, abstract_opt_state)
  return TrainStepProgram(step, state_shardings, abstract_state)


def abstract_batch(runtime: Runtime, batch_size: int, sequence_length: int
                   ) -> dict[str, jax.ShapeDtypeStruct]:
  """The shapes, dtypes and shardings of a packed batch (`pretrain.data.packing`)."""
  shardings = runtime.batch_shardings()
  return {name: jax.ShapeDtypeStruct((batch_size, sequence_length),
                                     jnp.float32 if name == "weights" else jnp.int32,
                                     sharding=shardings[name])
          for name in BATCH_FEATURES}


def make_eval_step(model: LanguageModel) -> Callable:
  """(params, batch, byte_lengths) -> {nll_sum, weight_sum[, byte_sum]}: summed over the
  global batch, so batches (and hosts) combine exactly.

  `byte_lengths` is the int32 [vocab_size] table of the UTF-8 bytes each token id
  stands for (`pretrain.data.vocabularies.token_byte_lengths`); `byte_sum` is the bytes
  of the weighted targets, the denominator of bits per byte. None (a vocabulary without
  text) leaves it out.
  """
  def step(params, batch, byte_lengths=None):
    _, sums = loss_sums(model, params, batch)
    totals = {"nll_sum": sums["nll_sum"], "weight_sum": sums["weight_sum"]}
    if byte_lengths is not None:
      target_bytes = byte_lengths[batch["targets"]].astype(jnp.float32)
      totals["byte_sum"] = jnp.sum(target_bytes * batch["weights"].astype(jnp.float32))
    return totals
  return step
