r"""Scaling-law sweeps: train each family at each size to its compute-optimal budget, fit.

  python -m launch.sweep --families=griffin,hawk,mqa --sizes=0.5m,1m,2m \
      [--tokens_per_param=20] --workdir=DIR [--dry_run] [--gin_file=DATA.gin ...] \
      [--gin_param=B ...] [--batch_size=8 --sequence_length=128] [--max_steps=N]

For every (family, size) the sweep builds a model by the size rule below, computes its
compute-optimal budget (`tokens_per_param` x non-embedding parameters, Chinchilla's ~20
by default), and trains it with `python -m pretrain.train` in `DIR/runs/<family>_<size>`,
one run after another (or, with `--dry_run`, prints the commands for a cluster). It then
collects each run's final evaluation loss against its training FLOPs (FLOPs per token
from `model.counting` x tokens trained), fits L(C) = E + A·C^(-α) per family
(`launch.scaling_fit`) and writes `sweep.csv`, `fit.json`, `scaling.png` and
`scaling.md` in DIR.

Every run warms its learning rate up over `warmup_fraction` of its steps (the
optimizer's fixed default would make a short run all warm-up) and may get a common
`--peak_learning_rate`.

Resuming: a run whose metrics hold the final evaluation (at its last step) is finished
and not run again; an unfinished run is started with the same command, and the trainer
resumes it from its newest checkpoint. So an interrupted sweep is resumed by running
the same command again.

Size rule (per family; also in docs/demos.md). A size names a target number of
non-embedding parameters ("0.5m", "2m", "1.3b"). Candidates are widths D on a grid of
32 that are multiples of the head size, with depths whose aspect ratio D/depth lies
within a factor 3 of 64 (Kaplan et al. 2020 find the loss within a few percent over
aspect ratios of ~20-200). The candidate whose non-embedding count (`model.counting`,
exact) is closest to the target in log ratio wins, ties going to the aspect ratio
closest to 64. Griffin needs depth >= 3 (at least one local-attention block), the
others depth >= 2. Derived widths follow the Griffin presets (docs/model.md#presets): MLP expansion
3, D_RNN ~ 4D/3 rounded to a multiple of the heads, heads = D / head_dim with head_dim
32 below D = 256, 64 below 768 and 128 above (the paper's 128 at its sizes), RG-LRU
gates block-diagonal with one block per head, Griffin's local window half the training
sequence (the paper: 1024 for 2048), MQA global attention. At toy sizes the grid is
coarse: a family may land up to ~15% from the target, which the FLOPs axis absorbs.
"""
from __future__ import annotations

from pretrain import quiet  # pylint: disable=unused-import  # first: see its docstring
import csv
import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
from typing import Dict, Iterable, List, Optional, Sequence

from absl import flags
import gin

from launch import scaling_fit
from model import counting
from model.config import ModelConfig, model_config_to_dict
from pretrain import cli
from pretrain import gin_config
from pretrain.errors import UserError, usage_error

FAMILY_PATTERNS = {
    "griffin": ("recurrent", "recurrent", "attention"),
    "hawk": ("recurrent",),
    "mqa": ("attention",),
    "gateloop": ("gateloop",),
}
ASPECT_RATIO = 64
ASPECT_TOLERANCE = 3   # depths with D/depth in [64/3, 64*3] are candidates
WIDTH_STEP = 32
MAX_WIDTH = 16384
MLP_EXPANSION = 3
CSV_FIELDS = ("family", "size", "target_params", "non_embedding_params", "total_params",
              "width", "depth", "rnn_width", "num_heads", "train_steps", "tokens",
              "flops_per_token", "flops", "eval_loss", "workdir")


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
                    sequence_length: int) -> ModelConfig:
  """The size rule (module docstring): nearest count to `target` at aspect ~64."""
  min_depth = 3 if family == "griffin" else 2
  best, best_key = None, None
  for width in range(WIDTH_STEP, MAX_WIDTH + 1, WIDTH_STEP):
    if width % head_dim_for(width):
      continue
    low = max(min_depth, math.ceil(width / (ASPECT_TOLERANCE * ASPECT_RATIO)))
    high = max(low, math.floor(ASPECT_TOLERANCE * width / ASPECT_RATIO))
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
  eval_loss: Optional[float] = None

  @property
  def name(self) -> str:
    return f"{self.family}_{self.size}"

  @property
  def tokens(self) -> int:
    return self.train_steps * self.batch_size * self.sequence_length

  @property
  def flops_per_token(self) -> float:
    return counting.training_flops_per_token(self.config, self.sequence_length)

  @property
  def flops(self) -> float:
    return self.flops_per_token * self.tokens

  def row(self) -> Dict[str, object]:
    counts = counting.analytic_param_counts(self.config)
    return {"family": self.family, "size": self.size, "target_params": self.target_params,
            "non_embedding_params": counts.non_embedding, "total_params": counts.total,
            "width": self.config.width, "depth": self.config.depth,
            "rnn_width": self.config.rnn_width, "num_heads": self.config.num_heads,
            "train_steps": self.train_steps, "tokens": self.tokens,
            "flops_per_token": f"{self.flops_per_token:.6g}", "flops": f"{self.flops:.6g}",
            "eval_loss": "" if self.eval_loss is None else f"{self.eval_loss:.6f}",
            "workdir": self.workdir}


def plan(families: Sequence[str], sizes: Sequence[str], *, tokens_per_param: float,
         batch_size: int, sequence_length: int, vocab_size: int, workdir: str,
         max_steps: Optional[int] = None, warmup_fraction: float = 0.1,
         peak_learning_rate: Optional[float] = None) -> List[Run]:
  """Every run of the sweep, with its model and compute-optimal number of steps."""
  runs = []
  for family in families:
    for size in sizes:
      target = parse_size(size)
      config = config_for_size(family, target, vocab_size, sequence_length)
      tokens = tokens_per_param * non_embedding_params(config)
      steps = max(1, math.ceil(tokens / (batch_size * sequence_length)))
      if max_steps is not None:
        steps = min(steps, max_steps)
      runs.append(Run(family, size, target, config, steps, batch_size, sequence_length,
                      os.path.join(workdir, "runs", f"{family}_{size}"),
                      warmup_steps=int(math.ceil(warmup_fraction * steps)),
                      peak_learning_rate=peak_learning_rate))
  return runs


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
  return "\n".join(lines) + "\n"


def command(run: Run, gin_files: Sequence[str], gin_params: Sequence[str],
            python: str = sys.executable) -> List[str]:
  args = [python, "-m", "pretrain.train"]
  args += [f"--gin_file={f}" for f in gin_files]
  args.append(f"--gin_file={os.path.join(run.workdir, 'sweep_run.gin')}")
  args += [f"--gin_param={p}" for p in gin_params]
  args.append(f"--workdir={run.workdir}")
  return args


def final_eval_loss(run: Run) -> Optional[float]:
  """The evaluation loss logged at the run's last step, or None if it is not finished."""
  path = os.path.join(run.workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return None
  loss = None
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue  # a line cut short by a kill
      if row.get("step") == run.train_steps and row.get("eval_loss") is not None:
        loss = float(row["eval_loss"])
  return loss


def execute(runs: Iterable[Run], gin_files: Sequence[str], gin_params: Sequence[str],
            log=print) -> None:
  """Trains every unfinished run in turn; fills in `eval_loss`."""
  for run in runs:
    run.eval_loss = final_eval_loss(run)
    if run.eval_loss is not None:
      log(f"[sweep] {run.name}: finished (eval loss {run.eval_loss:.4f}), skipped")
      continue
    os.makedirs(run.workdir, exist_ok=True)
    with open(os.path.join(run.workdir, "sweep_run.gin"), "w", encoding="utf-8") as f:
      f.write(run_gin(run))
    args = command(run, gin_files, gin_params)
    log(f"[sweep] {run.name}: {non_embedding_params(run.config):,} non-embedding params, "
        f"{run.train_steps} steps, {run.tokens:,} tokens, {run.flops:.3g} FLOPs")
    log("[sweep]   " + shlex.join(args))
    with open(os.path.join(run.workdir, "sweep_train.log"), "a", encoding="utf-8") as out:
      result = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
      raise UserError(
          f"run {run.name} failed with exit code {result.returncode}; see "
          f"{os.path.join(run.workdir, 'sweep_train.log')}. Fix it and run the same "
          "sweep command again: finished runs are kept, this one resumes.")
    run.eval_loss = final_eval_loss(run)
    if run.eval_loss is None:
      raise UserError(
          f"run {run.name} exited without a final evaluation at step {run.train_steps} "
          f"in {run.workdir}/metrics.jsonl; the data config needs a validation split")


def write_results(runs: Sequence[Run], workdir: str, log=print) -> Dict[str, object]:
  """sweep.csv, fit.json, scaling.png and scaling.md from finished runs."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "sweep.csv"), "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
    writer.writeheader()
    for run in runs:
      writer.writerow(run.row())
  points, fits, fit_json = {}, {}, {}
  for family in dict.fromkeys(run.family for run in runs):
    done = [r for r in runs if r.family == family and r.eval_loss is not None]
    points[family] = ([r.flops for r in done], [r.eval_loss for r in done])
    if len({r.flops for r in done}) >= 2:
      fits[family] = scaling_fit.fit_scaling_law(*points[family])
      fit_json[family] = fits[family].to_json()
    else:
      fit_json[family] = {"error": "fewer than 2 finished runs at distinct compute"}
  with open(os.path.join(workdir, "fit.json"), "w", encoding="utf-8") as f:
    json.dump(fit_json, f, indent=2)
  scaling_fit.plot_scaling(points, fits, os.path.join(workdir, "scaling.png"))
  table = runs_table_markdown(runs) + "\n\n" + scaling_fit.fit_table_markdown(fits) + "\n"
  with open(os.path.join(workdir, "scaling.md"), "w", encoding="utf-8") as f:
    f.write(table)
  log(table)
  return fit_json


def runs_table_markdown(runs: Sequence[Run]) -> str:
  rows = ["| family | size | non-embedding params | D | depth | heads | steps | tokens | "
          "FLOPs | eval loss |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in runs:
    loss = "—" if r.eval_loss is None else f"{r.eval_loss:.4f}"
    rows.append(f"| {r.family} | {r.size} | {non_embedding_params(r.config):,} | "
                f"{r.config.width} | {r.config.depth} | {r.config.num_heads} | "
                f"{r.train_steps} | {r.tokens:,} | {r.flops:.3g} | {loss} |")
  return "\n".join(rows)


def vocab_size_from_gin(gin_files: Sequence[str], gin_params: Sequence[str]) -> int:
  """VOCAB_SIZE as the run's Gin config defines it (ModelConfig.vocab_size otherwise).

  Raises:
    UserError (exit code 2): a bad Gin file or binding, or neither value bound.
  """
  gin_config.parse(gin_files, gin_params)
  try:
    for query in ("%VOCAB_SIZE", "ModelConfig.vocab_size"):
      try:
        return int(gin.query_parameter(query))
      except ValueError:
        continue
  finally:
    gin.clear_config()
  raise usage_error("the Gin files define neither VOCAB_SIZE nor ModelConfig.vocab_size; "
                    "pass --vocab_size")


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Command-line flags, defined only when run as a program so that importing this
  module next to other entry points (tests, notebooks) cannot clash."""
  flags.DEFINE_list("families", ["griffin", "hawk", "mqa"],
                    f"Model families, from {sorted(FAMILY_PATTERNS)}.")
  flags.DEFINE_list("sizes", ["0.5m", "1m", "2m"],
                    "Target non-embedding parameter counts, e.g. 0.5m,1m,2m.")
  flags.DEFINE_float("tokens_per_param", 20.0,
                     "Compute-optimal budget: tokens per non-embedding parameter.",
                     lower_bound=0.0)
  flags.DEFINE_string("workdir", None, "Sweep directory (runs/ and the results).")
  flags.DEFINE_bool("dry_run", False, "Print the launch commands instead of running them.")
  flags.DEFINE_multi_string("gin_file", ["configs/quickstart.gin"],
                            "Trainer/data Gin files of every run (the model is the sweep's).")
  flags.DEFINE_multi_string("gin_param", [], "Extra Gin bindings of every run.")
  flags.DEFINE_integer("batch_size", 8, "Global batch (sequences) of every run.",
                       lower_bound=1)
  flags.DEFINE_integer("sequence_length", 128, "Tokens per sequence of every run.",
                       lower_bound=1)
  flags.DEFINE_integer("vocab_size", None, "Vocabulary size (default: the Gin VOCAB_SIZE).",
                       lower_bound=1)
  flags.DEFINE_float("warmup_fraction", 0.1, "Warm-up steps as a fraction of each run.",
                     lower_bound=0.0, upper_bound=1.0)
  flags.DEFINE_float("peak_learning_rate", None,
                     "Peak learning rate of every run (default: the Gin config's).")
  flags.DEFINE_integer("max_steps", None,
                       "Cap on the steps of each run (for smoke tests; breaks the "
                       "compute-optimal budget, which the table then shows).", lower_bound=1)
  flags.mark_flag_as_required("workdir")
  flags.register_validator("workdir", lambda value: value is None or bool(value.strip()),
                           message="--workdir must name a directory")


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  unknown = sorted(set(FLAGS.families) - set(FAMILY_PATTERNS))
  if unknown:
    raise usage_error(f"unknown families {unknown}; expected some of "
                      f"{sorted(FAMILY_PATTERNS)}")
  for size in FLAGS.sizes:
    try:
      parse_size(size)
    except ValueError as error:
      raise usage_error(f"--sizes: {error}") from None
  workdir = os.path.abspath(os.path.expanduser(FLAGS.workdir))
  vocab_size = FLAGS.vocab_size or vocab_size_from_gin(FLAGS.gin_file, FLAGS.gin_param)
  runs = plan(FLAGS.families, FLAGS.sizes, tokens_per_param=FLAGS.tokens_per_param,
              batch_size=FLAGS.batch_size, sequence_length=FLAGS.sequence_length,
              vocab_size=vocab_size, workdir=workdir, max_steps=FLAGS.max_steps,
              warmup_fraction=FLAGS.warmup_fraction,
              peak_learning_rate=FLAGS.peak_learning_rate)
  if FLAGS.dry_run:
    print(runs_table_markdown(runs))
    for run in runs:
      print(f"# {run.name}: write {os.path.join(run.workdir, 'sweep_run.gin')}:")
      print("\n".join("#   " + line for line in run_gin(run).splitlines()))
      print(shlex.join(command(run, FLAGS.gin_file, FLAGS.gin_param)))
    return
  execute(runs, FLAGS.gin_file, FLAGS.gin_param)
  write_results(runs, workdir)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
