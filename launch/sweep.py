r"""Scaling-law studies: plan the runs, run them here or on a cluster, collect, fit.

  python -m launch.sweep --families=griffin,hawk,mqa --sizes=0.5m,1m,2m \
      [--tokens_per_param=20] --workdir=DIR [--dry_run] [--gin_file=DATA.gin ...] \
      [--gin_param=B ...] [--batch_size=8 --sequence_length=128] [--max_steps=N]
  python -m launch.sweep --families=griffin,hawk,mqa --flop_budgets=1e15,3e15,1e16 \
      --points_per_budget=5 [--isoflop_spread=3] --workdir=DIR \
      [--backend=local|slurm|gke|tpu_vm] [--parallel=N] [--max_retries=1] [--dry_run]
  python -m launch.sweep --design=wsd --families=griffin,hawk,mqa --sizes=0.5m,1m,2m \
      --cooldown_tokens_per_param=5,10,20,40 [--cooldown_fraction=0.2] --workdir=DIR
  python -m launch.sweep ... [--lr_sweep=1e-3,3e-3,1e-2 [--lr_sweep_sizes=2]]
  python -m launch.sweep --train_optimum=C --workdir=DIR [the study's flags]

`--design=wsd` is the forked design (`launch.wsd_design`: one constant-rate run per
size, cooldowns forked from its checkpoints); `--lr_sweep` fits a learning rate per
size before the study (`launch.size_rule`); `--train_optimum` trains the model the
study's fit recommends for a larger budget and scores its forecast (`launch.ladder`).

With the default `--design=cosine`, two designs. With `--sizes`, every (family, size)
gets a model by the size rule below and the compute-optimal budget `tokens_per_param`
x non-embedding parameters (Chinchilla's ~20 by default). With `--flop_budgets` (the isoFLOP design,
`plan_isoflop`), every budget gets `--points_per_budget` sizes around its expected
optimum, each trained for the steps that spend the budget by the trainer's own FLOPs
count (`pretrain.flops`, the numerator of MFU). Each run is `python -m pretrain.train`
in `DIR/runs/<name>` with the user's Gin files, the run's model and budget as bindings,
then the user's bindings.

`--backend` picks where the runs execute (`launch.sweep_dispatch`: N at a time here,
one SLURM job array, a GKE JobSet per run, a TPU queued resource per run); `--dry_run`
prints the plan and every job spec; locally, a progress line with an ETA goes to
stderr as runs start and end (`launch.sweep_progress`). What a run needs is read from
its directory (finished, running, interrupted, failed, pending), so running the same
command again resumes a study, retries failed runs up to `--max_retries`, and never
redoes finished work. Once every run is finished the sweep writes `sweep.csv` (what
`launch.scaling_fit` reads: `params`, `tokens`, `flops`, `flop_budget`, `loss`,
`bits_per_byte` (empty where the vocabulary has no text), ...),
`fit.json`, `scaling.png` and `scaling.md` (L(C) = E + A·C^(-α) per family) in DIR; the
three Chinchilla approaches are `python -m launch.scaling_fit --runs=DIR`
(docs/scaling.md).

Every run warms its learning rate up over `warmup_fraction` of its steps (the
optimizer's fixed default would make a short run all warm-up) and may get a common
`--peak_learning_rate`.

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
import collections
import csv
import dataclasses
import io
import json
import math
import os
import re
import shlex
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from absl import flags
import gin

from launch import common
from launch import ladder
from launch import scaling_fit
from launch import sweep_dispatch
from launch import sweep_progress
from launch import size_rule
from launch import wsd_design
from model import block_registry
from model import counting
from model.config import ModelConfig, model_config_to_dict
from pretrain import cli
from pretrain import flops as flops_lib
from pretrain import gin_config
from pretrain import storage
from pretrain.errors import UserError, usage_error

# Griffin mixes two block types; every other family is one registered block type alone
# (its registry entry's `family`: hawk, mqa, gateloop, ...), read live from the registry.
FAMILY_PATTERNS = collections.ChainMap({"griffin": ("recurrent", "recurrent", "attention")},
                                       block_registry.FAMILIES)
ASPECT_RATIO = 64
ASPECT_TOLERANCE = 3   # depths with D/depth in [64/3, 64*3] are candidates
WIDTH_STEP = 32
MAX_WIDTH = 16384
MLP_EXPANSION = 3
ORPHAN_POLL_S = 2.0
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
  flop_budget: Optional[float] = None     # isoFLOP design: the budget this run spends
  eval_loss: Optional[float] = None
  eval_bits_per_byte: Optional[float] = None   # None too where the vocabulary has no text
  # The forked (WSD) design (launch.wsd_design): "stable" or "fork", the run's name,
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
                 peak_learning_rate: Optional[float] = None) -> List[Run]:
  """The isoFLOP design: for every budget C, `points_per_budget` sizes spread evenly in
  log N over [N*/spread, N*·spread] around the expected optimum N* (C = 6·N·D with
  D = tokens_per_param·N, so N* = sqrt(C / (6·tokens_per_param))), each trained for
  the steps that spend C by the trainer's own FLOPs count (`pretrain.flops`, the MFU
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
        config = config_for_size(family, target, vocab_size, sequence_length)
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
    lines += ["", f"# The schedule of a {run.role} run (launch.wsd_design, size_rule, ladder).",
              "import pretrain.checkpointing", *run.extra_gin]
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


def final_eval(run: Run) -> Optional[dict]:
  """The evaluation row logged at the run's last step (`eval_loss` and, where the
  vocabulary has text, `eval_bits_per_byte`), or None if the run is not finished."""
  path = storage.join(run.workdir, "metrics.jsonl")
  if not storage.exists(path):
    return None
  final = None
  for line in storage.read_text(path).splitlines():
    line = line.strip()
    if not line:
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue  # a line cut short by a kill
    if row.get("step") == run.train_steps and row.get("eval_loss") is not None:
      final = row
  return final


def collect(run: Run) -> bool:
  """Sets the run's final `eval_loss` and `eval_bits_per_byte` from its metrics (None
  while unfinished); returns whether it finished."""
  row = final_eval(run) or {}
  run.eval_loss = row.get("eval_loss")
  run.eval_bits_per_byte = row.get("eval_bits_per_byte")
  return run.eval_loss is not None


def execute(runs: Sequence[Run], gin_files: Sequence[str], gin_params: Sequence[str], *,
            backend: str = "local", parallel: int = 1, max_retries: int = 1,
            cluster: Optional[sweep_dispatch.ClusterOptions] = None, study_dir: str = "",
            dry_run: bool = False, log=print) -> Dict[str, str]:
  """Starts every run that is not finished or running (sweep_dispatch); fills in the
  final evaluation of the finished ones (`collect`). Returns each run's state.

  A cooldown fork starts once its stable run has finished: locally as soon as it has,
  on a cluster at the next run of the command (a dry run prints those forks' specs
  after the others')."""
  todo, states, given_up_before = [], {}, 0
  by_name = {run.name: run for run in runs}

  def ready(job: sweep_dispatch.Job) -> bool:
    source = by_name[job.name].source
    return source is None or final_eval(by_name[source]) is not None
  for run in runs:
    state, failures = sweep_dispatch.run_state(run.workdir, collect(run))
    states[run.name] = state
    if state == sweep_dispatch.FAILED and failures > max_retries:
      log(f"[sweep] {run.name}: failed {failures} times (more than --max_retries="
          f"{max_retries}); not retried; see {run.workdir}")
      given_up_before += 1
      continue
    if state in (sweep_dispatch.FINISHED, sweep_dispatch.RUNNING):
      detail = (f"eval loss {run.eval_loss:.4f}" if run.eval_loss is not None
                else "started elsewhere")
      log(f"[sweep] {run.name}: {state} ({detail}), skipped")
      continue
    if run.source is not None and states.get(run.source) == sweep_dispatch.RUNNING:
      # Its stable run trains outside this sweep (an earlier, killed one): looked at
      # again once that has ended.
      log(f"[sweep] {run.name}: waits for {run.source}, which is still running")
      continue
    log(f"[sweep] {run.name}: {state}; {non_embedding_params(run.config):,} non-embedding "
        f"params, {run.train_steps} steps, {run.tokens:,} tokens, {run.flops:.3g} FLOPs")
    # Locally, this interpreter; on a cluster, the nodes' `python` (after --setup).
    python = sys.executable if backend == "local" else "python"
    todo.append(sweep_dispatch.Job(run.name, run.workdir,
                                   command(run, gin_files, gin_params, python), run.flops))
  if backend == "local":
    if dry_run:
      for job in todo:
        if not ready(job):
          print(f"# once {by_name[job.name].source} has finished:")
        print(shlex.join(job.wrapped(sys.executable)))
      return states
    progress = sweep_progress.Progress(
        {job.name: job.work for job in todo}, parallel,
        finished=sum(s == sweep_dispatch.FINISHED for s in states.values()),
        running=sum(s == sweep_dispatch.RUNNING for s in states.values()),
        failed=given_up_before)
    given_up = sweep_dispatch.run_local(
        todo, parallel, max_retries, lambda job: final_eval(by_name[job.name]) is not None,
        log, progress, ready)
    for run in runs:
      states[run.name] = sweep_dispatch.run_state(run.workdir, collect(run))[0]
    if given_up:
      write_results(runs, study_dir, log=log)
      raise UserError(f"runs {given_up} failed more than --max_retries={max_retries} times; "
                      "their logs are sweep_train.log in their directories. Fix the cause "
                      "and run the same command again (finished runs are kept)")
    return states
  cluster = cluster or sweep_dispatch.ClusterOptions()
  later = [job for job in todo if not ready(job)]
  sweep_dispatch.submit_cluster(backend, [j for j in todo if ready(j)], cluster, study_dir,
                                dry_run, log)
  if later and dry_run:
    print("# Submitted by a later run of this command, once each fork's stable run has "
          "finished (launch.fork copies its checkpoint first):")
    sweep_dispatch.submit_cluster(backend, later, cluster, study_dir, dry_run, log)
  elif later:
    log(f"[sweep] {len(later)} fork(s) wait for their stable runs; run the same command "
        "again once those have finished")
  return states


def write_results(runs: Sequence[Run], workdir: str, log=print) -> Dict[str, object]:
  """sweep.csv, fit.json, scaling.png and scaling.md from finished runs."""
  table_csv = io.StringIO(newline="")
  writer = csv.DictWriter(table_csv, fieldnames=CSV_FIELDS)
  writer.writeheader()
  for run in runs:
    writer.writerow(run.row())
  storage.write_text(storage.join(workdir, "sweep.csv"), table_csv.getvalue())
  if any(run.flop_budget is not None for run in runs):
    log("[sweep] isoFLOP design: fit the three approaches with "
        f"`python -m launch.scaling_fit --runs={workdir} --plots={workdir}/plots`")
  points, fits, fit_json = {}, {}, {}
  for family in dict.fromkeys(run.family for run in runs):
    # A stable run's end point is not cooled down: the forks are the (N, D) points.
    done = [r for r in runs if r.family == family and r.eval_loss is not None
            and r.role != wsd_design.STABLE]
    points[family] = ([r.flops for r in done], [r.eval_loss for r in done])
    if len({r.flops for r in done}) >= 2:
      fits[family] = scaling_fit.fit_scaling_law(*points[family])
      fit_json[family] = fits[family].to_json()
    else:
      fit_json[family] = {"error": "fewer than 2 finished runs at distinct compute"}
  storage.write_text(storage.join(workdir, "fit.json"), json.dumps(fit_json, indent=2))
  with tempfile.TemporaryDirectory() as staging:  # matplotlib writes local files
    if not any(losses for _, losses in points.values()):
      points = {}   # nothing finished (every run given up): an empty figure
    scaling_fit.plot_scaling(points, fits, os.path.join(staging, "scaling.png"))
    storage.copy(os.path.join(staging, "scaling.png"), storage.join(workdir, "scaling.png"))
  table = runs_table_markdown(runs) + "\n\n" + scaling_fit.fit_table_markdown(fits) + "\n"
  if any(run.role for run in runs):
    table += "\n" + wsd_design.cost_markdown(wsd_design.study_cost(runs)) + "\n"
  storage.write_text(storage.join(workdir, "scaling.md"), table)
  log(table)
  return fit_json


def runs_table_markdown(runs: Sequence[Run]) -> str:
  rows = ["| family | size | non-embedding params | D | depth | heads | steps | tokens | "
          "FLOPs | eval loss | bits/byte |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in runs:
    loss = "—" if r.eval_loss is None else f"{r.eval_loss:.4f}"
    per_byte = "—" if r.eval_bits_per_byte is None else f"{r.eval_bits_per_byte:.4f}"
    rows.append(f"| {r.family} | {r.size} | {non_embedding_params(r.config):,} | "
                f"{r.config.width} | {r.config.depth} | {r.config.num_heads} | "
                f"{r.train_steps} | {r.tokens:,} | {r.flops:.3g} | {loss} | {per_byte} |")
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
  flags.DEFINE_enum("design", "cosine", ("cosine", "wsd"),
                    "cosine: every run decays to its own end (--sizes or --flop_budgets); "
                    "wsd: one stable run per size, cooldowns forked from it "
                    "(launch.wsd_design).")
  flags.DEFINE_list("cooldown_tokens_per_param", ["5", "10", "20", "40"],
                    "WSD design: the forks' tokens per non-embedding parameter.")
  flags.DEFINE_float("cooldown_fraction", 0.2, "WSD design: share of each fork's steps "
                     "spent cooling down.")
  flags.DEFINE_enum("cooldown_shape", "1-sqrt", ("linear", "1-sqrt"),
                    "WSD design: the cooldown's shape (Hägele et al. find 1-sqrt best).")
  flags.DEFINE_float("train_optimum", None, "The ladder (launch.ladder): train each "
                     "family's compute-optimal model for this many FLOPs, as the study's "
                     "approach-3 fit predicts, and score the forecast.", lower_bound=0.0)
  flags.DEFINE_enum("metric", "loss", tuple(scaling_fit.METRICS),
                    "The ladder: the fitted and forecast metric (final eval_loss or "
                    "eval_bits_per_byte).")
  flags.DEFINE_integer("replicates", 200, "The ladder: bootstrap replicates of the fit.",
                       lower_bound=10)
  flags.DEFINE_list("lr_sweep", [], "Size rule (launch.size_rule): learning rates probed "
                    "at the smallest sizes, e.g. 1e-3,3e-3,1e-2; every run then trains at "
                    "the fitted rate for its size (replaces --peak_learning_rate).")
  flags.DEFINE_integer("lr_sweep_sizes", 2, "Size rule: how many of the smallest sizes "
                       "are probed.", lower_bound=1)
  flags.DEFINE_float("lr_sweep_tokens_per_param", 20.0, "Size rule: the probes' tokens "
                     "per non-embedding parameter.", lower_bound=0.0)
  flags.DEFINE_list("flop_budgets", [], "IsoFLOP design: training FLOP budgets, e.g. "
                    "1e15,3e15,1e16 (replaces --sizes).")
  flags.DEFINE_integer("points_per_budget", 5, "IsoFLOP design: sizes per budget.",
                       lower_bound=1)
  flags.DEFINE_float("isoflop_spread", 3.0, "IsoFLOP design: sizes span N*/spread to "
                     "N*·spread around the expected optimum N*.", lower_bound=1.0)
  flags.DEFINE_enum("backend", "local", sweep_dispatch.BACKENDS, "Where the runs execute.")
  flags.DEFINE_integer("parallel", sweep_dispatch.default_parallel(),
                       "Local backend: runs at a time (default: one per 4 cores).",
                       lower_bound=1)
  flags.DEFINE_integer("max_retries", 1, "Times a failed run is started again.",
                       lower_bound=0)
  # Cluster backends: every run gets the same resources (see the launchers).
  flags.DEFINE_string("job_name", "sweep", "Cluster job name prefix.")
  flags.DEFINE_string("setup", "", "Cluster: shell line before each run (venv, cd).")
  flags.DEFINE_multi_string("env", [], "Cluster: NAME=VALUE environment of each run.")
  flags.DEFINE_integer("nodes", 1, "slurm: nodes per run.", lower_bound=1)
  flags.DEFINE_integer("gpus_per_node", 8, "slurm: GPUs per node.", lower_bound=1)
  flags.DEFINE_string("time", None, "slurm: wall-clock limit per run.")
  flags.DEFINE_string("partition", None, "slurm: partition.")
  flags.DEFINE_string("account", None, "slurm: account.")
  flags.DEFINE_string("image", None, "gke: container image with this repository.")
  flags.DEFINE_string("tpu_type", None, "gke, tpu_vm: slice per run, e.g. v5p-8.")
  flags.DEFINE_string("zone", None, "tpu_vm: zone of the queued resources.")
  flags.DEFINE_string("project", None, "tpu_vm: Google Cloud project.")
  flags.DEFINE_string("runtime_version", "v2-alpha-tpuv5", "tpu_vm: TPU VM software.")
  flags.DEFINE_string("remote_dir", "griffin-pretrain",
                      "tpu_vm: repository checkout on each worker.")
  flags.mark_flag_as_required("workdir")
  flags.register_validator("workdir", lambda value: value is None or bool(value.strip()),
                           message="--workdir must name a directory")


def _budgets(texts: Sequence[str]) -> List[float]:
  try:
    return common.positive_numbers(texts, "--flop_budgets", "number of FLOPs",
                                   "1e15,3e15,1e16")
  except ValueError as error:
    raise usage_error(str(error)) from None


def _cluster_options(backend: str) -> sweep_dispatch.ClusterOptions:
  """The cluster flags, with the ones `backend` needs checked."""
  required = {"gke": ("image", "tpu_type"), "tpu_vm": ("tpu_type", "zone")}.get(backend, ())
  missing = [f"--{name}" for name in required if not getattr(FLAGS, name)]
  if missing:
    raise usage_error(f"--backend={backend} needs {' and '.join(missing)}")
  if FLAGS.tpu_type:
    common.TpuSlice(FLAGS.tpu_type)  # a bad type is a usage error now, not at submission
  return sweep_dispatch.ClusterOptions(
      job_name=FLAGS.job_name, setup=FLAGS.setup, env=common.parse_env_flags(FLAGS.env),
      nodes=FLAGS.nodes, gpus_per_node=FLAGS.gpus_per_node, time_limit=FLAGS.time, partition=FLAGS.partition,
      account=FLAGS.account, image=FLAGS.image, tpu_type=FLAGS.tpu_type, zone=FLAGS.zone,
      project=FLAGS.project, runtime_version=FLAGS.runtime_version,
      remote_dir=FLAGS.remote_dir)


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
  budgets = _budgets(FLAGS.flop_budgets)
  cluster = _cluster_options(FLAGS.backend) if FLAGS.backend != "local" else None
  workdir = FLAGS.workdir if FLAGS.workdir.startswith("gs://") else os.path.abspath(
      os.path.expanduser(FLAGS.workdir))
  vocab_size = FLAGS.vocab_size or vocab_size_from_gin(FLAGS.gin_file, FLAGS.gin_param)
  if FLAGS.train_optimum is not None:
    _train_optimum(workdir, vocab_size, cluster)
    return
  runs, probe_gin = _plan_runs(budgets, vocab_size, workdir)
  if FLAGS.lr_sweep:
    probes = size_rule.plan_probes(
        plan(FLAGS.families, FLAGS.sizes, tokens_per_param=FLAGS.lr_sweep_tokens_per_param,
             batch_size=FLAGS.batch_size, sequence_length=FLAGS.sequence_length,
             vocab_size=vocab_size, workdir=workdir, warmup_fraction=FLAGS.warmup_fraction),
        _rates(), count=FLAGS.lr_sweep_sizes, workdir=workdir, extra_gin=probe_gin)
    if FLAGS.dry_run:
      print("# The learning-rate probes (launch.size_rule); the study's runs follow at the "
            "rates of the rule fitted to them:")
      print(runs_table_markdown(probes))
    states = _run_all(probes, storage.join(workdir, "lr_sweep"), cluster)
    if FLAGS.dry_run or not _all_finished(states):
      return
    rules = size_rule.fit_rules(probes)
    for line in size_rule.warnings(rules):
      print(line)
    storage.write_text(storage.join(workdir, "size_rule.json"), size_rule.rules_json(
        rules, _rates(), FLAGS.lr_sweep_sizes, FLAGS.lr_sweep_tokens_per_param))
    for run in runs:
      run.peak_learning_rate = rules[run.family](non_embedding_params(run.config))
  if FLAGS.dry_run:
    print(runs_table_markdown(runs))
    if FLAGS.backend == "local":
      for run in runs:
        print(f"# {run.name}: the run's bindings (--gin_param):")
        print("\n".join("#   " + line for line in run_gin(run).splitlines()))
  states = _run_all(runs, workdir, cluster)
  if not FLAGS.dry_run and _all_finished(states):
    write_results(runs, workdir)


def _train_optimum(workdir: str, vocab_size: int,
                   cluster: Optional[sweep_dispatch.ClusterOptions]) -> None:
  """The ladder (launch.ladder): each family's compute-optimal model at the budget,
  forecast written first, trained, then scored."""
  budget = FLAGS.train_optimum
  runs, forecasts = [], {}
  for family in FLAGS.families:
    name = f"{family}_optimum_C{budget_label(budget)}"
    n_opt, forecast, fit = ladder.optimum_size(workdir, name, family, budget,
                                               metric=FLAGS.metric,
                                               replicates=FLAGS.replicates)
    # One isoFLOP point puts N* = sqrt(C / (6·tokens_per_param)) on N_opt.
    (base,) = plan_isoflop([family], [budget], points_per_budget=1, spread=1.0,
                           tokens_per_param=budget / (6 * n_opt.value ** 2),
                           batch_size=FLAGS.batch_size,
                           sequence_length=FLAGS.sequence_length, vocab_size=vocab_size,
                           workdir=workdir, warmup_fraction=FLAGS.warmup_fraction)
    run = ladder.ladder_run(base, workdir, name, FLAGS.peak_learning_rate)
    forecasts[run.name] = forecast or ladder.make_forecast(run, fit, n_opt, FLAGS.metric,
                                                           record=not FLAGS.dry_run)
    runs.append(run)
    p = forecasts[run.name]["predicted"]
    print(f"[ladder] {run.name}: {non_embedding_params(run.config):,} non-embedding params, "
          f"{run.tokens:,} tokens; forecast {FLAGS.metric} {p['value']:.4f} "
          f"[{p['low']:.4f}, {p['high']:.4f}]")
  if FLAGS.dry_run:
    print(runs_table_markdown(runs))
  states = _run_all(runs, storage.join(workdir, "ladder"), cluster)
  if FLAGS.dry_run or not _all_finished(states):
    return
  for run in runs:
    print(ladder.report_line(run.name, ladder.score(run, forecasts[run.name], FLAGS.metric)))


def _rates() -> List[float]:
  try:
    return size_rule.parse_rates(FLAGS.lr_sweep)
  except ValueError as error:
    raise usage_error(str(error)) from None


def _plan_runs(budgets: Sequence[float], vocab_size: int, workdir: str
               ) -> Tuple[List[Run], Tuple[str, ...]]:
  """The study's runs by the chosen design, and the schedule bindings its LR probes
  share with them (launch.size_rule)."""
  shared = dict(batch_size=FLAGS.batch_size, sequence_length=FLAGS.sequence_length,
                vocab_size=vocab_size, workdir=workdir, warmup_fraction=FLAGS.warmup_fraction)
  if FLAGS.design != "wsd":
    if budgets:
      return plan_isoflop(FLAGS.families, budgets, points_per_budget=FLAGS.points_per_budget,
                          spread=FLAGS.isoflop_spread,
                          tokens_per_param=FLAGS.tokens_per_param,
                          peak_learning_rate=FLAGS.peak_learning_rate, **shared), ()
    return plan(FLAGS.families, FLAGS.sizes, tokens_per_param=FLAGS.tokens_per_param,
                max_steps=FLAGS.max_steps, peak_learning_rate=FLAGS.peak_learning_rate,
                **shared), ()
  if budgets:
    raise usage_error("--design=wsd plans its runs from --sizes and "
                      "--cooldown_tokens_per_param; drop --flop_budgets")
  try:
    options = wsd_design.WsdOptions(
        tuple(float(t) for t in FLAGS.cooldown_tokens_per_param), FLAGS.cooldown_fraction,
        FLAGS.cooldown_shape)
  except ValueError as error:
    raise usage_error(str(error).replace("could not convert string to float",
                                         "--cooldown_tokens_per_param: not a number")
                      ) from None
  runs = wsd_design.plan_wsd(
      plan(FLAGS.families, FLAGS.sizes, tokens_per_param=1.0,
           peak_learning_rate=FLAGS.peak_learning_rate, **shared),
      options, workdir=workdir, warmup_fraction=FLAGS.warmup_fraction)
  if FLAGS.dry_run:
    print(wsd_design.cost_markdown(wsd_design.study_cost(runs)))
  else:
    storage.makedirs(workdir)
    storage.write_text(storage.join(workdir, "design.json"),
                       wsd_design.design_json(runs, options))
  return runs, ("OptimizerConfig.schedule = 'wsd'",
                f"OptimizerConfig.cooldown_shape = {options.cooldown_shape!r}",
                f"OptimizerConfig.cooldown_fraction = {options.cooldown_fraction!r}")


def _all_finished(states: Dict[str, str]) -> bool:
  """Whether every run finished; otherwise one line naming those that did not."""
  waiting = sorted(name for name, state in states.items()
                   if state != sweep_dispatch.FINISHED)
  if waiting:
    print(f"[sweep] {len(waiting)} run(s) not finished yet ({', '.join(waiting[:5])}"
          f"{', ...' if len(waiting) > 5 else ''}); run the same command again later")
  return not waiting


def _run_all(runs: Sequence[Run], study_dir: str,
             cluster: Optional[sweep_dispatch.ClusterOptions]) -> Dict[str, str]:
  """`execute` until nothing is left to start; locally, runs still training from an
  earlier (killed) sweep are waited for, then looked at again: finished, or resumed.
  `study_dir` gets the cluster logs and, if runs are given up, their partial results
  (the LR probes and the ladder keep theirs apart from the study's)."""
  while True:
    states = execute(runs, FLAGS.gin_file, FLAGS.gin_param, backend=FLAGS.backend,
                     parallel=FLAGS.parallel, max_retries=FLAGS.max_retries, cluster=cluster,
                     study_dir=study_dir, dry_run=FLAGS.dry_run,
                     log=(lambda _: None) if FLAGS.dry_run else print)
    if FLAGS.dry_run:
      return states
    orphans = [r.name for r in runs if FLAGS.backend == "local"
               and states[r.name] == sweep_dispatch.RUNNING
               and sweep_dispatch.running_here(r.workdir)]
    if not orphans:
      return states
    print(f"[sweep] waiting for {', '.join(orphans)}, still running from an earlier sweep")
    while any(sweep_dispatch.running_here(r.workdir) for r in runs if r.name in orphans):
      time.sleep(ORPHAN_POLL_S)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
