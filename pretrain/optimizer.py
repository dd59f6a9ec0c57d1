"""AdamW with warm-up + cosine or warmup-stable-decay (WSD), clipping and a weight-decay
mask, built with optax.

Defaults follow docs/model.md#optimizer (Chinchilla-style): β2 = 0.95, weight decay 0.1, linear
warm-up then cosine decay to 10% of the peak, global-norm clipping at 1.0. Weight decay
only applies to matrices that mix features: norms, biases, embeddings and the RG-LRU's
Λ (`a_param`) are left alone, because decaying them pulls the model towards a
degenerate point (unit-free scales, zero decay rates) rather than regularising it.

The WSD schedule (Hägele et al. 2024) holds the peak after warm-up and cools down over
the last `cooldown_fraction` of the run. Its value is a function of the global step
and the run's own length only, so a run that restores a stable-phase checkpoint of
step S and trains on to T (a cooldown fork, `launch.sweeps.wsd_design`) follows exactly the
curve of a run trained to T from the start: before its cooldown starts, every WSD run
with the same warm-up and peak has the same learning rate.

Under μP (`model.parametrization`) each parameter's learning rate is the schedule's
times its multiplier (1/m for hidden matrices): the whole AdamW update, decoupled decay
included, is scaled per parameter after AdamW, as a per-group learning rate scales it
in PyTorch's AdamW (and in the `mup` package's MuAdamW). The standard parametrisation
adds nothing to the chain, so its optimizer state is what it always was.

Gradient accumulation is not an optax wrapper here: the train step scans over
microbatches itself (pretrain/steps.py), which keeps the loss and the gradient exactly
those of the big batch.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax

from model import parametrization
from model.config import ModelConfig
from plumbing.errors import usage_error

# Path components (matched as whole names, case-insensitive) of parameters that get no
# weight decay: biases, RMSNorm scales (`*_norm/scale`), the tied embedding, the RG-LRU's
# Λ (`a_param`), the CG-LRU phase rates (`theta`) and GateLoop's input-independent
# transitions (`fixed_magnitude`, `fixed_phase`), which play Λ's role there.
NO_DECAY_PATTERNS = (
    r"bias", r".*norm.*", r"scale", r".*embed.*", r"a_param", r"theta", r"fixed_.*",
)
SCHEDULES = ("cosine", "wsd")
COOLDOWN_SHAPES = ("linear", "1-sqrt")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW hyper-parameters and the learning-rate schedule.

  Attributes:
    peak_learning_rate: learning rate at the end of warm-up.
    warmup_steps: linear warm-up from 0 to the peak over this many steps.
    final_learning_rate_fraction: the decay (cosine, or WSD's cooldown) ends at this
      fraction of the peak at the last training step.
    schedule: "cosine" (warm-up, cosine decay over the rest of the run) or "wsd"
      (warm-up, constant at the peak, cooldown over the last `cooldown_fraction`).
    cooldown_fraction: WSD: share of the run's steps spent cooling down (0: constant to
      the end, what the stable run of a forked study uses).
    cooldown_shape: WSD: "linear" or "1-sqrt" (lr ∝ 1 − sqrt(progress), which Hägele et
      al. find slightly better than linear).
    b1: Adam β1.
    b2: Adam β2 (0.95 is the usual choice for language-model pretraining).
    eps: Adam ε.
    weight_decay: decoupled weight decay, applied only where `weight_decay_mask` says.
    clip_norm: global gradient-norm clip; None or 0 disables.
    no_decay_patterns: regexes; a parameter whose path has a component fully matching
      one of them gets no weight decay.
  """
  peak_learning_rate: float = 3e-4
  warmup_steps: int = 1000
  final_learning_rate_fraction: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  clip_norm: float | None = 1.0
  no_decay_patterns: Sequence[str] = NO_DECAY_PATTERNS
  schedule: str = "cosine"
  cooldown_fraction: float = 0.2
  cooldown_shape: str = "linear"

  def __post_init__(self):
    if self.peak_learning_rate <= 0:
      raise ValueError(f"OptimizerConfig.peak_learning_rate must be > 0, got "
                       f"{self.peak_learning_rate}")
    if self.warmup_steps < 0:
      raise ValueError(f"OptimizerConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
    if not 0 <= self.final_learning_rate_fraction <= 1:
      raise ValueError("OptimizerConfig.final_learning_rate_fraction must lie in [0, 1], "
                       f"got {self.final_learning_rate_fraction}")
    if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
      raise ValueError(f"OptimizerConfig.b1 and b2 must lie in [0, 1), got "
                       f"{self.b1}, {self.b2}")
    if self.weight_decay < 0:
      raise ValueError(f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay}")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"OptimizerConfig.schedule must be one of {SCHEDULES}, got "
                       f"{self.schedule!r}")
    if not 0 <= self.cooldown_fraction <= 1:
      raise ValueError("OptimizerConfig.cooldown_fraction must lie in [0, 1], got "
                       f"{self.cooldown_fraction}")
    if self.cooldown_shape not in COOLDOWN_SHAPES:
      raise ValueError(f"OptimizerConfig.cooldown_shape must be one of {COOLDOWN_SHAPES}, "
                       f"got {self.cooldown_shape!r}")
    object.__setattr__(self, "no_decay_patterns", tuple(self.no_decay_patterns))


def cooldown_start(config: OptimizerConfig, total_steps: int) -> int:
  """The step at which a WSD run of `total_steps` leaves its peak: total minus
  round(cooldown_fraction · total), never inside the warm-up. A forked study
  (`launch.sweeps.wsd_design`) restores its stable run's checkpoint of exactly this step."""
  warmup = min(config.warmup_steps, total_steps)
  cooldown = min(int(round(config.cooldown_fraction * total_steps)), total_steps - warmup)
  return total_steps - cooldown


def wsd_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Linear warm-up to the peak, constant to `cooldown_start`, then a linear or 1−sqrt
  cooldown to `final_fraction · peak` at `total_steps` (constant after)."""
  warmup = min(config.warmup_steps, total_steps)
  start = cooldown_start(config, total_steps)
  cooldown = total_steps - start
  peak, final = config.peak_learning_rate, config.final_learning_rate_fraction
  shape = config.cooldown_shape

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = peak * step / warmup if warmup else jnp.float32(peak)
    progress = jnp.clip((step - start) / max(cooldown, 1), 0.0, 1.0)
    left = 1.0 - (progress if shape == "linear" else jnp.sqrt(progress))
    cool = peak * (final + (1.0 - final) * left)
    return jnp.where(step < warmup, warm, jnp.where(step < start, peak, cool))
  return schedule


def learning_rate_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Linear warm-up to the peak, then cosine decay to `final_fraction * peak` at
  `total_steps`, or WSD's constant phase and cooldown (`wsd_schedule`).

  With fewer total steps than warm-up steps the warm-up is shortened to the run, so a
  short smoke run still reaches its peak instead of training at a tiny rate throughout.
  """
  if total_steps < 1:
    raise ValueError(f"total_steps must be >= 1, got {total_steps}")
  if config.schedule == "wsd":
    return wsd_schedule(config, total_steps)
  warmup = min(config.warmup_steps, total_steps)
  peak = config.peak_learning_rate
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1),
      end_value=config.final_learning_rate_fraction * peak)


def _path_names(path: tuple[Any, ...]) -> list[str]:
  return [jax.tree_util.keystr((key,), simple=True) for key in path]


def weight_decay_mask(params: Any, patterns: Sequence[str] = NO_DECAY_PATTERNS) -> Any:
  """A pytree of bools like `params`: True where weight decay applies.

  A parameter is excluded when any component of its path fully matches one of
  `patterns` (case-insensitive), e.g. `blocks/rg_lru/a_param` or `final_norm/scale`.
  """
  compiled = [re.compile(p, re.IGNORECASE) for p in patterns]

  def decays(path, _):
    return not any(c.fullmatch(name) for name in _path_names(path) for c in compiled)

  return jax.tree_util.tree_map_with_path(decays, params)


def scale_per_parameter(multipliers: Any) -> optax.GradientTransformation:
  """Multiplies each parameter's update by its entry of `multipliers` (a tree of floats
  structured like the params); stateless."""
  def scale(updates, params=None):
    del params
    return jax.tree.map(lambda update, multiplier: update * multiplier, updates, multipliers)
  return optax.stateless(scale)


def make_optimizer(config: OptimizerConfig, total_steps: int,
                   learning_rate_multipliers: Any = None) -> optax.GradientTransformation:
  """Clip by global norm, then AdamW with the schedule and the weight-decay mask, then
  (under μP) each parameter's learning-rate multiplier.

  The mask is a callable of the params, so the same transformation serves any model
  tree (and abstract trees for sharding the optimizer state).

  Args:
    config: the hyper-parameters.
    total_steps: the run's length (the schedule's).
    learning_rate_multipliers: a tree like the params of per-parameter multipliers
      (`model.parametrization.learning_rate_multipliers`); None adds no transformation.
  """
  schedule = learning_rate_schedule(config, total_steps)
  patterns = config.no_decay_patterns
  parts = []
  if config.clip_norm:
    parts.append(optax.clip_by_global_norm(config.clip_norm))
  parts.append(optax.adamw(
      learning_rate=schedule, b1=config.b1, b2=config.b2, eps=config.eps,
      weight_decay=config.weight_decay,
      mask=lambda params: weight_decay_mask(params, patterns)))
  if learning_rate_multipliers is not None:
    parts.append(scale_per_parameter(learning_rate_multipliers))
  return optax.chain(*parts)


def model_optimizer(config: OptimizerConfig, total_steps: int, model_config: ModelConfig,
                    abstract_params: Any) -> optax.GradientTransformation:
  """`make_optimizer` with the learning-rate multipliers of the model's parametrisation
  (none under the standard one). A parameter μP has no role for is a usage error, one
  line naming it, before anything is compiled."""
  try:
    multipliers = parametrization.learning_rate_multipliers(model_config, abstract_params)
  except ValueError as error:
    raise usage_error(str(error)) from None
  return make_optimizer(config, total_steps, multipliers)
