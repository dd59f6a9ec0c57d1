r"""The runs of a scaling-law study: the size rule, the designs, each run's Gin and command.

Which models a study trains (`config_for_size`), for how long (`plan`: tokens per
parameter; `plan_isoflop`: FLOP budgets; the forked design, `launch.sweeps.wsd_design`, is
built on `plan`) and what each run executes (`run_gin`, `command`). Kept apart from
where runs execute (`launch.sweeps.sweep_execute` and its backends) and from how their
results are read (`launch.sweeps.sweep_results`), so a design can be planned, printed and
tested without either.

Size rule (per family; also in docs/demos.md). A size names a target number of
non-embedding parameters ("0.5m", "2m", "1.3b"). Candidates are widths D on a grid of
32 that are multiples of the head size, with depths whose aspect ratio D/depth lies
within a factor 3 of 64 (Kaplan et al. 2020 find the loss within a few percent over
aspect ratios of ~20-200). The candidate whose non-embedding count (`model.counting`,
exact) is closest to the target in log ratio wins, ties going to the aspect ratio
closest to 64 (`--aspect_tolerance` of launch.sweep changes the factor 3). Griffin
needs depth >= 3 (at least one local-attention block), the others depth >= 2. Derived
widths follow the Griffin presets (docs/model.md#presets): MLP expansion 3, D_RNN ~
4D/3 rounded to a multiple of the heads, heads = D / head_dim with head_dim 32 below
D = 256, 64 below 768 and 128 above (the paper's 128 at its sizes), RG-LRU
gates block-diagonal with one block per head, Griffin's local window half the training
sequence (the paper: 1024 for 2048), MQA global attention. At toy sizes the grid is
coarse: a family may land up to ~15% from the target, which the FLOPs axis absorbs.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

from model import block_registry
from model import counting
from model.config import ModelConfig, model_config_to_dict
from pretrain.observability import flops as flops_lib

# Griffin mixes two block types; every other family is one registered block type alone
# (its registry entry's `family`: hawk, mqa, gateloop, ...; a block that declares none is
# a family of its own name), read live from the registry.
FAMILY_PATTERNS = collections.ChainMap({"griffin": ("recurrent", "recurrent", "attention")},
                                       block_registry.FAMILIES)
ASPECT_RATIO = 64
ASPECT_TOLERANCE = 3   # depths with D/depth in [64/3, 64*3] are candidates
WIDTH_STEP = 32
MAX_WIDTH = 16384
MLP_EXPANSION = 3
# `params` (non-embedding), `tokens`, `loss` or `bits_per_byte`, `flops` and
# `flop_budget` are what `launch.scaling_fit` reads.
CSV_FIELDS = ("run", "family", "size", "target_params", "params", "total_params",
              "width", "depth", "rnn_width", "num_heads", "train_steps", "tokens",
              "flops_per_token", "flops", "flop_budget", "loss", "bits_per_byte", "workdir",
              "role", "own_flops")


def parse_size(text: str) -> int:
  """'0.5m' -> 500000, '1.3b' -> 1300000000, '200k' -> 200000, '5000' -> 5000."""
  match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmbKMB]?)\s*", text)
  if not match:
    raise ValueError(f"cannot read the size {text!r}; write e.g. 0.5m, 2m, 200k or 1.3b")
  scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}[match.group(2).lower()]
  value = int(round(float(match.group(1)) * scale))
  if value < 1000:
    raise ValueError(f"size {text!r} is below 1000 parameters; nothing can be built")
  return value


def head_dim_for(width: int) -> int:
  return 32 if width < 256 else 64 if width < 768 else 128


def family_config(family: str, width: int, depth: int, vocab_size: int,
                  sequence_length: int) -> ModelConfig:
  """The model of `family` at width D and `depth`, everything else by the size rule."""
  if family not in FAMILY_PATTERNS:
    raise ValueError(f"unknown family {family!r}; expected one of {sorted(FAMILY_PATTERNS)}")
  heads = max(1, width // head_dim_for(width))
  rnn_width = max(heads, int(round(4 * width / 3 / heads)) * heads)
  return ModelConfig(
      vocab_size=vocab_size, width=width, rnn_width=rnn_width, num_heads=heads,
      depth=depth, block_pattern=FAMILY_PATTERNS[family],
      attention_window=(max(1, sequence_length // 2) if family == "griffin" else None),
      mlp_expansion=MLP_EXPANSION, dtype="float32")


def non_embedding_params(config: ModelConfig) -> int:
  return counting.analytic_param_counts(config).non_embedding


def config_for_size(family: str, target: int, vocab_size: int,
                    sequence_length: int, *,
                    aspect_tolerance: float = ASPECT_TOLERANCE) -> ModelConfig:
  """The size rule (module docstring): nearest count to `target` at aspect ~64.

  `aspect_tolerance` widens (or narrows) the candidate depths: D/depth within a factor
  `aspect_tolerance` of 64 (default 3). At toy sizes the default leaves width 32 one
  depth, so a study below ~100k parameters can ask for narrower-and-deeper models
  (e.g. 12: width 32 at depths up to 6) to get more distinct sizes.
  """
  if aspect_tolerance < 1:
    raise ValueError(f"aspect_tolerance must be at least 1, got {aspect_tolerance}")
  min_depth = 3 if family == "griffin" else 2
  best, best_key = None, None
  for width in range(WIDTH_STEP, MAX_WIDTH + 1, WIDTH_STEP):
    if width % head_dim_for(width):
      continue
    low = max(min_depth, math.ceil(width / (aspect_tolerance * ASPECT_RATIO)))
    high = max(low, math.floor(aspect_tolerance * width / ASPECT_RATIO))
    for depth in range(low, high + 1):
      config = family_config(family, width, depth, vocab_size, sequence_length)
      miss = abs(math.log(non_embedding_params(config) / target))
      key = (round(miss, 3), abs(math.log(width / depth / ASPECT_RATIO)))
      if best_key is None or key < best_key:
        best, best_key = config, key
    if best is not None and non_embedding_params(
        family_config(family, width, low, vocab_size, sequence_length)) > 4 * target:
      break
  return best


@dataclasses.dataclass
class Run:
  """One training run of the sweep and, once collected, its result."""
  family: str
  size: str
  target_params: int
  config: ModelConfig
  train_steps: int
  batch_size: int
  sequence_length: int
  workdir: str
  warmup_steps: int = 0
  peak_learning_rate: Optional[float] = None
  flop_budget: Optional[float] = None     # isoFLOP design: the budget this run spends
  eval_loss: Optional[float] = None
  eval_bits_per_byte: Optional[float] = None   # None too where the vocabulary has no text
  # The forked (WSD) design (launch.sweeps.wsd_design): "stable" or "fork", the run's name,
  # its schedule bindings, bindings the user's may not override (a stable run's
  # checkpoint steps), and for a fork the stable run (directory and name) and
  # checkpoint step it starts from.
  role: str = ""
  label: Optional[str] = None
  extra_gin: Tuple[str, ...] = ()
  final_gin: Tuple[str, ...] = ()
  fork_from: Optional[str] = None
  fork_step: int = 0
  source: Optional[str] = None

  @property
  def name(self) -> str:
    if self.label is not None:
      return self.label
    if self.flop_budget is None:
      return f"{self.family}_{self.size}"
    return f"{self.family}_C{budget_label(self.flop_budget)}_{self.size}"

  @property
  def tokens(self) -> int:
    return self.train_steps * self.batch_size * self.sequence_length

  @property
  def flops_per_token(self) -> float:
    return flops_lib.training_flops_per_token(self.config, self.sequence_length)

  @property
  def flops(self) -> float:
    """The compute of the run's end point: all its steps, a fork's stable prefix too."""
    return self.flops_per_token * self.tokens

  @property
  def own_flops(self) -> float:
    """The compute this run adds to the study: a fork's steps after its fork step."""
    return self.flops * (self.train_steps - self.fork_step) / self.train_steps

  def row(self) -> Dict[str, object]:
    counts = counting.analytic_param_counts(self.config)
    return {"run": self.name, "family": self.family, "size": self.size,
            "target_params": self.target_params,
            "params": counts.non_embedding, "total_params": counts.total,
            "width": self.config.width, "depth": self.config.depth,
            "rnn_width": self.config.rnn_width, "num_heads": self.config.num_heads,
            "train_steps": self.train_steps, "tokens": self.tokens,
            "flops_per_token": f"{self.flops_per_token:.6g}", "flops": f"{self.flops:.6g}",
            "flop_budget": "" if self.flop_budget is None else f"{self.flop_budget:.6g}",
            "loss": "" if self.eval_loss is None else f"{self.eval_loss:.6f}",
            "bits_per_byte": ("" if self.eval_bits_per_byte is None
                              else f"{self.eval_bits_per_byte:.6f}"),
            "workdir": self.workdir, "role": self.role,
            "own_flops": f"{self.own_flops:.6g}"}


def plan(families: Sequence[str], sizes: Sequence[str], *, tokens_per_param: float,
         batch_size: int, sequence_length: int, vocab_size: int, workdir: str,
         max_steps: Optional[int] = None, warmup_fraction: float = 0.1,
         peak_learning_rate: Optional[float] = None,
         aspect_tolerance: float = ASPECT_TOLERANCE) -> List[Run]:
  """Every run of the sweep, with its model and compute-optimal number of steps."""
  runs = []
  for family in families:
    for size in sizes:
      target = parse_size(size)
      config = config_for_size(family, target, vocab_size, sequence_length,
                               aspect_tolerance=aspect_tolerance)
      tokens = tokens_per_param * non_embedding_params(config)
      steps = max(1, math.ceil(tokens / (batch_size * sequence_length)))
      if max_steps is not None:
        steps = min(steps, max_steps)
      runs.append(Run(family, size, target, config, steps, batch_size, sequence_length,
                      os.path.join(workdir, "runs", f"{family}_{size}"),
                      warmup_steps=int(math.ceil(warmup_fraction * steps)),
                      peak_learning_rate=peak_learning_rate))
  return runs


def budget_label(flops: float) -> str:
  """1e15 -> '1e15', 3e15 -> '3e15', 2.5e16 -> '2.5e16' (run names, no '+')."""
  mantissa, exponent = f"{flops:.3g}".split("e") if "e" in f"{flops:.3g}" else (
      f"{flops:.3g}", "0")
  return f"{mantissa}e{int(exponent)}"


def size_label(params: float) -> str:
  """A target size as launch.sweep's --sizes would write it: 123456 -> '123k'."""
  if params >= 1e9:
    return f"{params / 1e9:.3g}b"
  if params >= 1e6:
    return f"{params / 1e6:.3g}m"
  return f"{params / 1e3:.3g}k"


def plan_isoflop(families: Sequence[str], budgets: Sequence[float], *,
                 points_per_budget: int, spread: float, tokens_per_param: float,
                 batch_size: int, sequence_length: int, vocab_size: int, workdir: str,
                 warmup_fraction: float = 0.1,
                 peak_learning_rate: Optional[float] = None,
                 aspect_tolerance: float = ASPECT_TOLERANCE) -> List[Run]:
  """The isoFLOP design: for every budget C, `points_per_budget` sizes spread evenly in
  log N over [N*/spread, N*·spread] around the expected optimum N* (C = 6·N·D with
  D = tokens_per_param·N, so N* = sqrt(C / (6·tokens_per_param))), each trained for
  the steps that spend C by the trainer's own FLOPs count (`pretrain.observability.flops`, the MFU
  numerator), rounded to whole steps. Sizes the size rule maps to the same model are
  kept once."""
  runs = []
  tokens_per_step = batch_size * sequence_length
  for family in families:
    for budget in budgets:
      optimum = math.sqrt(budget / (6 * tokens_per_param))
      seen = set()
      for factor in _log_spaced(1 / spread, spread, points_per_budget):
        target = max(1000, int(round(optimum * factor)))
        config = config_for_size(family, target, vocab_size, sequence_length,
                                 aspect_tolerance=aspect_tolerance)
        if (config.width, config.depth) in seen:
          continue
        seen.add((config.width, config.depth))
        per_step = flops_lib.training_flops_per_token(config, sequence_length) * tokens_per_step
        steps = max(1, int(round(budget / per_step)))
        runs.append(Run(family, size_label(target), target, config, steps, batch_size,
                        sequence_length,
                        os.path.join(workdir, "runs", f"{family}_C{budget_label(budget)}_"
                                     f"{size_label(target)}"),
                        warmup_steps=int(math.ceil(warmup_fraction * steps)),
                        peak_learning_rate=peak_learning_rate, flop_budget=float(budget)))
  return runs


def _log_spaced(low: float, high: float, count: int) -> List[float]:
  if count == 1:
    return [1.0]
  return [low * (high / low) ** (i / (count - 1)) for i in range(count)]


def _gin_value(value) -> str:
  if isinstance(value, str):
    return repr(value)
  if isinstance(value, (tuple, list)):
    return "(" + "".join(f"{_gin_value(v)}, " for v in value) + ")"
  return repr(value)


def run_gin(run: Run) -> str:
  """The run's own Gin file: the whole model and the budget, after the user's files.

  The machine's scan options (`ModelConfig.scan`, from `ScanOptions.*` bindings) are
  left to the user's files, like in a checkpoint's metadata.
  """
  lines = [f"# launch.sweep: {run.family} at size {run.size} (target "
           f"{run.target_params:,} non-embedding parameters, got "
           f"{non_embedding_params(run.config):,}).",
           "import model.config", "import pretrain.trainer", ""]
  for name, value in model_config_to_dict(run.config).items():
    lines.append(f"ModelConfig.{name} = {_gin_value(value)}")
  lines += ["", f"TRAIN_STEPS = {run.train_steps}", f"BATCH_SIZE = {run.batch_size}",
            f"SEQUENCE_LENGTH = {run.sequence_length}",
            "TrainConfig.train_steps = %TRAIN_STEPS",
            "TrainConfig.batch_size = %BATCH_SIZE",
            "TrainConfig.sequence_length = %SEQUENCE_LENGTH",
            "TrainConfig.final_eval = True", "",
            "# Warm-up scaled with the run, so short runs are not all warm-up.",
            "import pretrain.optimizer",
            f"OptimizerConfig.warmup_steps = {run.warmup_steps}"]
  if run.peak_learning_rate is not None:
    lines.append(f"OptimizerConfig.peak_learning_rate = {run.peak_learning_rate!r}")
  if run.extra_gin:
    lines += ["", f"# The schedule of a {run.role} run "
              "(launch.sweeps.wsd_design, size_rule, ladder).",
              "import pretrain.checkpoints.checkpointer", *run.extra_gin]
  if run.final_gin:
    lines += ["# Also after the user's bindings, which may not override them:",
              *run.final_gin]
  return "\n".join(lines) + "\n"


def run_bindings(run: Run) -> List[str]:
  """`run_gin` as command-line bindings (no file to ship to a cluster's nodes)."""
  return [line for line in run_gin(run).splitlines()
          if line and not line.startswith(("#", "import "))]


def command(run: Run, gin_files: Sequence[str], gin_params: Sequence[str],
            python: str = "python") -> List[str]:
  """The run's training command: the user's files, the run's bindings, the user's; a
  fork's starts by copying its stable run's checkpoint (launch.fork)."""
  args = [python, "-m", "pretrain.train"]
  args += [f"--gin_file={f}" for f in gin_files]
  args += [f"--gin_param={p}" for p in run_bindings(run) + list(gin_params)
            + list(run.final_gin)]
  args.append(f"--workdir={run.workdir}")
  if run.fork_from is not None:
    args = [python, "-m", "launch.fork", f"--source={run.fork_from}",
            f"--step={run.fork_step}", f"--workdir={run.workdir}", "--"] + args
  return args
