r"""The forked (warmup-stable-decay) design of a scaling study.

  python -m launch.sweep --design=wsd --sizes=0.5m,1m,2m \
      --cooldown_tokens_per_param=5,10,20,40 [--cooldown_fraction=0.2] --workdir=DIR

Why: an (N, D) grid of S sizes x K token counts costs S·K full trainings under cosine
schedules, each decayed to its own end. With a constant learning rate and a short
cooldown (Hägele et al. 2024) one run per size, at the peak rate, serves every token
count: a cooldown forked from its checkpoint at the right step ends where a run
trained to that count from the start would (`pretrain.optimizer`'s WSD schedule is a
function of the global step). The grid then costs S stable runs plus S·K cooldowns.

Per size, with tokens per step B·T and non-embedding parameters N:
  - fork k targets D_k = tokens_per_param_k · N tokens, T_k ≈ D_k / (B·T) steps, cooling
    down over its last `cooldown_fraction` (the schedule's `cooldown_start`), so it
    forks at S_k = cooldown_start(T_k);
  - the S_k are rounded to a grain of about 1/8 of the smallest, so the stable run can
    save every gcd(S_k) steps and keep exactly those checkpoints (`keep_every`); then
    T_k is the shortest run whose cooldown starts at S_k: the fork's tokens differ from
    the target by at most about 1/16 of the smallest fork's stable phase and are
    recorded exactly;
  - every run of the size shares the warm-up (`warmup_fraction` of the shortest fork)
    and peak learning rate, so the stable run and each fork agree up to S_k;
  - the stable run trains to max S_k with the WSD schedule and no cooldown.

Compute: a fork's own cost is its cooldown, (T_k − S_k) steps; the stable run is paid
once. `study_cost` sets this beside the equivalent cosine grid (every fork trained
from scratch), written to the study's `design.json`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Dict, List, Sequence

from model import counting
from pretrain import optimizer as optimizer_lib

GRAIN_DIVISOR = 8
STABLE, FORK = "stable", "fork"


@dataclasses.dataclass(frozen=True)
class WsdOptions:
  """The design's flags: fork token counts and the cooldown's length and shape."""
  cooldown_tokens_per_param: tuple[float, ...]
  cooldown_fraction: float = 0.2
  cooldown_shape: str = "linear"

  def __post_init__(self):
    if not self.cooldown_tokens_per_param or any(
        not (t > 0 and math.isfinite(t)) for t in self.cooldown_tokens_per_param):
      raise ValueError("--cooldown_tokens_per_param needs positive token counts per "
                       f"parameter, e.g. 5,10,20,40; got {self.cooldown_tokens_per_param}")
    if not 0 < self.cooldown_fraction < 1:
      raise ValueError(f"--cooldown_fraction must lie strictly between 0 and 1 (a fork "
                       f"needs a stable prefix and a cooldown); got {self.cooldown_fraction}")
    if self.cooldown_shape not in optimizer_lib.COOLDOWN_SHAPES:
      raise ValueError(f"--cooldown_shape must be one of {optimizer_lib.COOLDOWN_SHAPES}; "
                       f"got {self.cooldown_shape!r}")


def tokens_label(value: float) -> str:
  """20 -> '20', 2.5 -> '2.5' (run names)."""
  return f"{value:g}"


def fork_schedule(target_steps: Sequence[int], fraction: float, warmup: int
                  ) -> List[tuple[int, int]]:
  """(fork step S_k, total steps T_k) for runs that target `target_steps`, in the same
  order (module docstring): S_k on a common grain, T_k the shortest run of the WSD
  schedule (`fraction`, `warmup`) whose cooldown starts at S_k."""
  config = optimizer_lib.OptimizerConfig(warmup_steps=warmup, schedule="wsd",
                                         cooldown_fraction=fraction)
  starts = [optimizer_lib.cooldown_start(config, t) for t in target_steps]
  grain = max(1, min(starts) // GRAIN_DIVISOR)
  floor = grain * math.ceil(max(warmup, 1) / grain)
  pairs = []
  for start in starts:
    fork = max(floor, grain * int(round(start / grain)))
    total = fork
    while optimizer_lib.cooldown_start(config, total) < fork:
      total += 1
    pairs.append((fork, total))
  return pairs


def plan_wsd(sizes: Sequence, options: WsdOptions, *, workdir: str,
             warmup_fraction: float = 0.1) -> list:
  """The stable run and forks of every run in `sizes` (one `launch.sweeps.sweep_design.Run` per
  family and size, as `launch.sweeps.sweep_design.plan` gives them: its model, batch and peak rate
  are kept, its steps replaced)."""
  runs = []
  for base in sizes:
    params = counting.analytic_param_counts(base.config).non_embedding
    tokens_per_step = base.batch_size * base.sequence_length
    targets = [max(1, math.ceil(t * params / tokens_per_step))
               for t in options.cooldown_tokens_per_param]
    warmup = int(math.ceil(warmup_fraction * min(targets)))
    pairs = fork_schedule(targets, options.cooldown_fraction, warmup)
    stride = math.gcd(*[fork for fork, _ in pairs])
    common = ("OptimizerConfig.schedule = 'wsd'",
              f"OptimizerConfig.cooldown_shape = {options.cooldown_shape!r}")
    stable = dataclasses.replace(
        base, train_steps=max(fork for fork, _ in pairs), warmup_steps=warmup, role=STABLE,
        label=f"{base.family}_{base.size}_{STABLE}",
        workdir=os.path.join(workdir, "runs", f"{base.family}_{base.size}_{STABLE}"),
        extra_gin=common + ("OptimizerConfig.cooldown_fraction = 0.0",
                            "TrainConfig.checkpoint_every = %CHECKPOINT_EVERY"),
        final_gin=(f"CHECKPOINT_EVERY = {stride}", f"CheckpointConfig.keep_every = {stride}"))
    runs.append(stable)
    seen = set()
    for tokens, (fork, total) in zip(options.cooldown_tokens_per_param, pairs):
      if total in seen:   # tiny sizes: two targets on one step count
        continue
      seen.add(total)
      name = f"{base.family}_{base.size}_wsd{tokens_label(tokens)}"
      runs.append(dataclasses.replace(
          stable, train_steps=total, role=FORK, label=name,
          workdir=os.path.join(workdir, "runs", name),
          extra_gin=common + (
              f"OptimizerConfig.cooldown_fraction = {options.cooldown_fraction!r}",),
          final_gin=(),
          fork_from=stable.workdir, fork_step=fork, source=stable.name))
  return runs


def study_cost(runs: Sequence) -> Dict[str, Dict[str, float]]:
  """Per family and in total: the study's compute (each stable prefix once, each fork's
  cooldown), the cosine grid's (every fork trained from scratch), their ratio."""
  out: Dict[str, Dict[str, float]] = {}
  for family in list(dict.fromkeys(r.family for r in runs)) + ["total"]:
    members = [r for r in runs if family in ("total", r.family)]
    spent = sum(r.own_flops for r in members)
    cosine = sum(r.flops for r in members if r.role != STABLE)
    out[family] = {"flops": spent, "cosine_grid_flops": cosine,
                   "ratio": spent / cosine if cosine else float("nan")}
  return out


def cost_markdown(cost: Dict[str, Dict[str, float]]) -> str:
  rows = ["| family | study FLOPs (stable once + cooldowns) | cosine grid FLOPs | ratio |",
          "| --- | --- | --- | --- |"]
  for family, c in cost.items():
    rows.append(f"| {family} | {c['flops']:.3g} | {c['cosine_grid_flops']:.3g} | "
                f"{c['ratio']:.2f} |")
  return "\n".join(rows)


def design_json(runs: Sequence, options: WsdOptions) -> str:
  """The study's record of its design: options, forks (source and step), costs."""
  return json.dumps({
      "design": "wsd", "options": dataclasses.asdict(options),
      "forks": {r.name: {"source": r.source, "fork_step": r.fork_step,
                         "train_steps": r.train_steps}
                for r in runs if r.role == FORK},
      "cost": study_cost(runs)}, indent=2)
