"""AdamW with warm-up + cosine decay, clipping and a weight-decay mask, built with optax.

Defaults follow docs/model.md#optimizer (Chinchilla-style): β2 = 0.95, weight decay 0.1, linear
warm-up then cosine decay to 10% of the peak, global-norm clipping at 1.0. Weight decay
only applies to matrices that mix features: norms, biases, embeddings and the RG-LRU's
Λ (`a_param`) are left alone, because decaying them pulls the model towards a
degenerate point (unit-free scales, zero decay rates) rather than regularising it.

Gradient accumulation is not an optax wrapper here: the train step scans over
microbatches itself (pretrain/steps.py), which keeps the loss and the gradient exactly
those of the big batch.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import jax
import optax

# Path components (matched as whole names, case-insensitive) of parameters that get no
# weight decay: biases, RMSNorm scales (`*_norm/scale`), the tied embedding, the RG-LRU's
# Λ (`a_param`), the CG-LRU phase rates (`theta`) and GateLoop's input-independent
# transitions (`fixed_magnitude`, `fixed_phase`), which play Λ's role there.
NO_DECAY_PATTERNS = (
    r"bias", r".*norm.*", r"scale", r".*embed.*", r"a_param", r"theta", r"fixed_.*",
)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW hyper-parameters and the learning-rate schedule.

  Attributes:
    peak_learning_rate: learning rate at the end of warm-up.
    warmup_steps: linear warm-up from 0 to the peak over this many steps.
    final_learning_rate_fraction: the cosine decays to this fraction of the peak at the
      last training step.
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
    object.__setattr__(self, "no_decay_patterns", tuple(self.no_decay_patterns))


def learning_rate_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Linear warm-up to the peak, then cosine decay to `final_fraction * peak` at `total_steps`.

  With fewer total steps than warm-up steps the warm-up is shortened to the run, so a
  short smoke run still reaches its peak instead of training at a tiny rate throughout.
  """
  if total_steps < 1:
    raise ValueError(f"total_steps must be >= 1, got {total_steps}")
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


def make_optimizer(config: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
  """Clip by global norm, then AdamW with the schedule and the weight-decay mask.

  The mask is a callable of the params, so the same transformation serves any model
  tree (and abstract trees for sharding the optimizer state).
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
  return optax.chain(*parts)
