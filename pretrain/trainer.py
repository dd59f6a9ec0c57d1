"""The training run: state, jitted train and eval steps, and the loop.

One jitted `train_step(state, batch) -> (state, metrics)` does the whole update: a
`lax.scan` over microbatches accumulates summed losses and gradients (so the result is
exactly the big batch's), then clipping and AdamW. The state is donated, so parameters
and optimizer state are updated in place; every array lives in the sharded layout that
`sharding/` derives from the model's logical axes.

The loop never waits for the device to report: step s's metrics are fetched after step
s+1 has been dispatched, checkpoints are written by Orbax in the background, and only
log, eval and checkpoint steps look at values at all. Each step's loss and gradient norm
are still checked (one step late) before any later state is saved, so a diverged run
stops without overwriting its newest good checkpoint.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import signal
import time
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax

from model import counting
from model.config import ModelConfig
from model.lm import LanguageModel, init_params, param_logical_axes
from pretrain import flops as flops_lib
from pretrain import load as load_lib
from pretrain.checkpointing import CheckpointConfig, Checkpointer
from pretrain.cli import UserError
from pretrain.metrics import MetricsWriter, StepTimer
from pretrain.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer
from sharding import partition
from sharding import rules as rules_lib
from sharding.mesh import MeshConfig, create_mesh


class TrainingDivergedError(UserError):
  """The loss or gradient became NaN or infinite."""


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """How long and how to train; Gin binds most fields to the shared macros.

  Attributes:
    train_steps: optimizer steps of the whole run (TRAIN_STEPS).
    batch_size: global batch in sequences (BATCH_SIZE).
    sequence_length: tokens per sequence (SEQUENCE_LENGTH).
    checkpoint_every: save every this many steps (CHECKPOINT_EVERY); also at the end.
    eval_every: evaluate on the validation split every this many steps (EVAL_EVERY);
      0 disables periodic evaluation.
    log_every: write a metrics row and a console line every this many steps (LOG_EVERY).
    seed: seeds parameter initialisation and the data order (SEED).
    microbatches: split each batch into this many microbatches and accumulate their
      gradients (same result as the full batch, less activation memory).
    z_loss_weight: weight of the z-loss, mean(log Z ²), which keeps the softmax
      normaliser near 1; 0 disables.
    eval_batches: validation batches per evaluation (None: the whole split).
    final_eval: evaluate once more after the last step.
    sample_prompt: if set, print a sample continuing this prompt after training.
    sample_tokens: new tokens of that sample.
    print_sharding: log the parameter sharding table at start-up.
  """
  train_steps: int = 1000
  batch_size: int = 8
  sequence_length: int = 512
  checkpoint_every: int = 500
  eval_every: int = 500
  log_every: int = 50
  seed: int = 0
  microbatches: int = 1
  z_loss_weight: float = 0.0
  eval_batches: Optional[int] = 16
  final_eval: bool = True
  sample_prompt: Optional[str] = None
  sample_tokens: int = 200
  print_sharding: bool = False

  def __post_init__(self):
    for name in ("train_steps", "batch_size", "sequence_length", "checkpoint_every",
                 "log_every", "microbatches", "sample_tokens"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"TrainConfig.{name} must be a positive integer, got {value!r}")
    if self.eval_every < 0:
      raise ValueError(f"TrainConfig.eval_every must be >= 0, got {self.eval_every}")
    if self.batch_size % self.microbatches:
      raise ValueError(f"TrainConfig.batch_size={self.batch_size} must be divisible by "
                       f"microbatches={self.microbatches}")
    if self.z_loss_weight < 0:
      raise ValueError(f"TrainConfig.z_loss_weight must be >= 0, got {self.z_loss_weight}")


class TrainState(NamedTuple):
  """Everything the jitted step updates. `step` counts completed updates."""
  step: jax.Array
  params: Any
  opt_state: Any


# -- losses --------------------------------------------------------------------------
def token_losses(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-token negative log-likelihood and log-normaliser, in float32."""
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return log_z - target_logit, log_z


def loss_sums(model: LanguageModel, params: Any, batch: Mapping[str, jax.Array],
              z_loss_weight: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Summed (not averaged) objective over a batch, and its parts.

  Sums make microbatch accumulation exact: the big batch's mean loss is the sum over
  microbatches divided by the total weight, and so is its gradient.
  """
  logits, _ = model.apply({"params": params}, batch["inputs"], batch["positions"])
  nll, log_z = token_losses(logits, batch["targets"])
  weights = batch["weights"].astype(jnp.float32)
  nll_sum = jnp.sum(nll * weights)
  z_sum = jnp.sum(jnp.square(log_z) * weights)
  objective = nll_sum + z_loss_weight * z_sum
  return objective, {"nll_sum": nll_sum, "z_sum": z_sum, "weight_sum": jnp.sum(weights)}


def _split_microbatches(batch: Mapping[str, jax.Array], count: int) -> dict[str, jax.Array]:
  """[B, ...] -> [count, B/count, ...], microbatch m taking rows m, m+count, ...

  Interleaved rows keep each device's rows spread evenly over microbatches, so the
  batch sharding of the leading axis survives the split without communication.
  """
  def split(x):
    rows = x.shape[0]
    return jnp.swapaxes(x.reshape((rows // count, count) + x.shape[1:]), 0, 1)
  return {name: split(x) for name, x in batch.items()}


def make_train_step(model: LanguageModel, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, microbatches: int = 1,
                    z_loss_weight: float = 0.0) -> Callable:
  """The un-jitted step: (state, batch) -> (new state, metrics of this step)."""
  grad_fn = jax.grad(lambda p, b: loss_sums(model, p, b, z_loss_weight), has_aux=True)

  def step(state: TrainState, batch: Mapping[str, jax.Array]):
    if microbatches == 1:
      grads, sums = grad_fn(state.params, batch)
    else:
      def accumulate(carry, micro):
        grads_acc, sums_acc = carry
        grads, sums = grad_fn(state.params, micro)
        return (jax.tree.map(jnp.add, grads_acc, grads),
                jax.tree.map(jnp.add, sums_acc, sums)), None
      zeros = jax.tree.map(jnp.zeros_like, state.params)
      zero_sums = {k: jnp.zeros((), jnp.float32) for k in ("nll_sum", "z_sum", "weight_sum")}
      (grads, sums), _ = jax.lax.scan(accumulate, (zeros, zero_sums),
                                      _split_microbatches(batch, microbatches))
    total_weight = jnp.maximum(sums["weight_sum"], 1.0)
    grads = jax.tree.map(lambda g: g / total_weight, grads)
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

  return step


def make_eval_step(model: LanguageModel) -> Callable:
  """(params, batch) -> {nll_sum, weight_sum}: summed, so batches combine exactly."""
  def step(params, batch):
    _, sums = loss_sums(model, params, batch)
    return {"nll_sum": sums["nll_sum"], "weight_sum": sums["weight_sum"]}
  return step


def host_scalar(x: jax.Array) -> float:
  """A replicated scalar as a Python float, also when it spans several processes."""
  return float(np.asarray(x.addressable_data(0)))


# -- set-up shared by train, evaluate, sample and load --------------------------------
class Setup:
  """Model, mesh and shardings for a model config: what every command needs.

  Attributes:
    config: the model's ModelConfig.
    mesh: the device mesh (all global devices).
    rules: the logical-axis rule table.
    model: the LanguageModel module.
    param_shardings: NamedShardings of the parameter tree.
    abstract_params: ShapeDtypeStructs (with shardings) of the parameter tree.
  """

  def __init__(self, config: ModelConfig, mesh_config: Optional[MeshConfig] = None):
    self.config = config
    self.mesh = create_mesh(mesh_config or MeshConfig())
    self.rules = rules_lib.logical_axis_rules()
    self.model = LanguageModel(config)
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    self.param_shardings = partition.param_shardings(
        self.mesh, param_logical_axes(config), shapes, self.rules)
    partition.check_no_large_replicated(shapes, self.param_shardings, self.mesh)
    self.abstract_params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes, self.param_shardings)
    self.replicated = partition.replicated(self.mesh)

  @contextlib.contextmanager
  def activation_context(self):
    """Mesh and logical rules in scope, so the model's activation constraints apply."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield

  def init_params(self, seed: int) -> Any:
    """Parameters created directly in their sharded layout."""
    fn = jax.jit(lambda key: init_params(self.config, key),
                 out_shardings=self.param_shardings)
    with self.activation_context():
      return fn(jax.random.key(seed))

  def global_batch(self, local_batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    return partition.make_global_batch(self.mesh, local_batch, self.rules)

  def batch_shardings(self, names: Iterable[str]) -> dict[str, Any]:
    sharding = partition.batch_sharding(self.mesh, 2, self.rules)
    return {name: sharding for name in names}


BATCH_FEATURES = ("inputs", "targets", "positions", "segment_ids", "weights")


def evaluate_batches(setup: Setup, params: Any, batches: Iterable[Mapping[str, np.ndarray]],
                     eval_fn: Optional[Callable] = None) -> tuple[float, int]:
  """Mean next-token NLL (nats/token) and token count over `batches`."""
  if eval_fn is None:
    eval_fn = jax.jit(make_eval_step(setup.model),
                      in_shardings=(setup.param_shardings, setup.batch_shardings(BATCH_FEATURES)),
                      out_shardings=setup.replicated)
  nll, weight = None, None
  with setup.activation_context():
    for local in batches:
      sums = eval_fn(params, setup.global_batch({k: local[k] for k in BATCH_FEATURES}))
      nll = sums["nll_sum"] if nll is None else nll + sums["nll_sum"]
      weight = sums["weight_sum"] if weight is None else weight + sums["weight_sum"]
  if weight is None:
    raise UserError("The evaluation data produced no batch")
  tokens = host_scalar(weight)
  if tokens == 0:
    raise UserError("The evaluation data holds no tokens")
  return host_scalar(nll) / tokens, int(tokens)


# -- the loop --------------------------------------------------------------------------
class _PreemptionFlag:
  """Whether to save and stop at a step boundary because SIGTERM arrived.

  With one process a Python SIGTERM handler sets a flag. With several, each host gets
  its own notice at its own moment, and a host that stopped alone would leave the
  others blocked in the next step's collectives; so the decision goes through JAX's
  preemption sync service instead (it catches SIGTERM itself and lets every process
  agree on the first step all of them can still reach), and all save that same step.
  """

  def __init__(self):
    self._multi_process = jax.process_count() > 1
    self._flag_set = False
    self._previous = None

  def __enter__(self):
    if self._multi_process:
      return self
    def handler(signum, frame):
      del frame
      logging.warning("Received signal %d: saving a checkpoint and stopping", signum)
      self._flag_set = True
    try:
      self._previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: no handler, no preemption saves
      self._previous = None
    return self

  def should_stop(self, step: int) -> bool:
    """Called by every process before each step (`step` = completed steps)."""
    if self._multi_process:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      if multihost_utils.reached_preemption_sync_point(step):
        logging.warning("Preemption notice: all processes save step %d and stop", step)
        return True
      return False
    return self._flag_set

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


@dataclasses.dataclass
class RunResult:
  """What a finished (or preempted) run reports."""
  last_step: int
  preempted: bool
  final_eval_loss: Optional[float]
  sample: Optional[str]


def train(workdir: str,
          train_config: Optional[TrainConfig] = None,
          model_config: Optional[ModelConfig] = None,
          optimizer_config: Optional[OptimizerConfig] = None,
          checkpoint_config: Optional[CheckpointConfig] = None,
          mesh_config: Optional[MeshConfig] = None,
          pipeline_factory: Optional[Callable[..., Any]] = None,
          on_ready: Optional[Callable[[], None]] = None) -> RunResult:
  """Trains (or resumes) the configured model in `workdir`.

  Args:
    workdir: run directory (checkpoints, metrics, TensorBoard).
    train_config, model_config, optimizer_config, checkpoint_config, mesh_config: the
      run's settings (default: constructed from Gin).
    pipeline_factory: builds the input pipeline; default `build_pipeline`.
    on_ready: called once everything is configured, before the first step (the CLI
      writes the operative Gin config there).

  Returns:
    A RunResult. Raises TrainingDivergedError on a NaN/inf loss.
  """
  cfg = train_config or TrainConfig()
  model_cfg = model_config or ModelConfig()
  opt_cfg = optimizer_config or OptimizerConfig()
  setup = Setup(model_cfg, mesh_config)
  pipeline = (pipeline_factory or build_pipeline)(cfg, setup)
  schedule = learning_rate_schedule(opt_cfg, cfg.train_steps)
  optimizer = make_optimizer(opt_cfg, cfg.train_steps)
  opt_shapes = jax.eval_shape(optimizer.init, setup.abstract_params)
  opt_shardings = partition.opt_state_shardings(optimizer, opt_shapes,
                                                setup.param_shardings, setup.mesh)
  abstract_opt = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      opt_shapes, opt_shardings)
  state_shardings = TrainState(setup.replicated, setup.param_shardings, opt_shardings)
  if model_cfg.vocab_size < pipeline.vocab_size:
    raise UserError(
        f"ModelConfig.vocab_size={model_cfg.vocab_size} is smaller than the data's "
        f"vocabulary ({pipeline.vocab_size} ids); set ModelConfig.vocab_size >= "
        f"{pipeline.vocab_size}")
  checkpointer = Checkpointer(workdir, checkpoint_config)
  writer = MetricsWriter(workdir, cfg.train_steps)
  writer.info(pipeline.describe())
  writer.info(f"model: {counting.count_params(model_cfg).total:,} parameters, "
              f"{flops_lib.training_flops_per_token(model_cfg, cfg.sequence_length):,.0f} "
              "training FLOPs/token")
  if cfg.print_sharding:
    writer.info(partition.format_sharding_table(setup.abstract_params, setup.param_shardings))

  init_opt = jax.jit(optimizer.init, out_shardings=opt_shardings)
  latest = checkpointer.latest_step()
  if latest is None:
    params = setup.init_params(cfg.seed)
    state = TrainState(jax.device_put(jnp.int32(0), setup.replicated), params,
                       init_opt(params))
    rng = jax.random.key(cfg.seed)
    writer.info(f"Starting a new run in {workdir}")
  else:
    restored = checkpointer.restore(latest, abstract_params=setup.abstract_params,
                                    abstract_opt_state=abstract_opt)
    opt_state = restored["opt_state"]
    if opt_state is None:  # a converted checkpoint: weights only
      opt_state = init_opt(restored["params"])
    state = TrainState(jax.device_put(jnp.int32(restored["step"]), setup.replicated),
                       restored["params"], opt_state)
    rng = restored["rng"] if restored["rng"] is not None else jax.random.key(cfg.seed)
    writer.info(f"Resuming from the checkpoint of step {restored['step']} in {workdir}")
  start_step = int(host_scalar(state.step))

  train_step = jax.jit(
      make_train_step(setup.model, optimizer, schedule, cfg.microbatches, cfg.z_loss_weight),
      in_shardings=(state_shardings, setup.batch_shardings(BATCH_FEATURES)),
      out_shardings=(state_shardings, setup.replicated),
      donate_argnums=(0,))
  eval_fn = jax.jit(make_eval_step(setup.model),
                    in_shardings=(setup.param_shardings,
                                  setup.batch_shardings(BATCH_FEATURES)),
                    out_shardings=setup.replicated)
  flops_per_token = flops_lib.training_flops_per_token(model_cfg, cfg.sequence_length)
  metadata = {"model_config": load_lib.model_config_to_dict(model_cfg),
              "vocabulary": load_lib.vocabulary_spec(pipeline.vocabulary),
              "sequence_length": cfg.sequence_length}
  if on_ready is not None:
    on_ready()

  def save(step: int, state: TrainState) -> None:
    checkpointer.save(step, params=state.params, opt_state=state.opt_state, rng=rng,
                      metadata=metadata)

  def run_eval(step: int, params: Any) -> float:
    loss, tokens = evaluate_batches(
        setup, params, pipeline.validation_batches(cfg.eval_batches), eval_fn)
    writer.log_eval(step, loss, tokens)
    return loss

  timer = StepTimer()
  pending: collections.deque = collections.deque()
  last_saved = start_step
  loop_start = time.perf_counter()
  eval_loss = None

  def check(step: int, metrics: Mapping[str, jax.Array]) -> None:
    """Fetches step `step`'s metrics (waiting for it), checks them, logs if due."""
    values = {k: host_scalar(v) for k, v in metrics.items()}
    if not all(math.isfinite(values[k]) for k in ("loss", "grad_norm", "param_norm")):
      checkpointer.wait()
      good = checkpointer.latest_step()
      where = (f"the newest good checkpoint (step {good}) is intact in "
               f"{checkpointer.directory}" if good is not None else "no checkpoint was written")
      raise TrainingDivergedError(
          f"Training diverged at step {step}: loss={values['loss']}, "
          f"grad_norm={values['grad_norm']}, param_norm={values['param_norm']}; stopped "
          f"without saving, {where}. Lower "
          "OptimizerConfig.peak_learning_rate or clip_norm, or raise warmup_steps.")
    if step % cfg.log_every and step != start_step + 1:
      return
    step_time = timer.mark(step)
    if step_time is None:  # first logged step: includes compilation
      step_time = (time.perf_counter() - loop_start) / (step - start_step)
    tokens_per_second = cfg.batch_size * cfg.sequence_length / step_time
    row = {
        "loss": values["loss"],
        "learning_rate": values["learning_rate"],
        "grad_norm": values["grad_norm"],
        "param_norm": values["param_norm"],
        "tokens_per_second": tokens_per_second,
        "step_time_s": step_time,
        "mfu": flops_lib.mfu(tokens_per_second, flops_per_token),
    }
    if cfg.z_loss_weight:
      row["z_loss"] = values["z_loss"]
    writer.log_train(step, row)

  def drain() -> None:
    while pending:
      check(*pending.popleft())

  preempted = False
  step = start_step
  try:
    with _PreemptionFlag() as preemption, setup.activation_context():
      for step_index in range(start_step, cfg.train_steps):
        if preemption.should_stop(step_index):
          preempted = True
          break
        batch = setup.global_batch(
            {k: v for k, v in pipeline.batch(step_index).items() if k in BATCH_FEATURES})
        state, metrics = train_step(state, batch)
        step = step_index + 1
        pending.append((step, metrics))
        while len(pending) > 1:  # step s-1's metrics, while step s runs
          check(*pending.popleft())
        due_checkpoint = step % cfg.checkpoint_every == 0
        due_eval = (cfg.eval_every and step % cfg.eval_every == 0
                    and not (cfg.final_eval and step == cfg.train_steps))
        if due_checkpoint or due_eval:
          drain()
        if due_checkpoint:
          save(step, state)
          last_saved = step
        if due_eval:
          run_eval(step, state.params)
        if due_checkpoint or due_eval:
          timer.restart(step)
      drain()
      if step != last_saved:
        save(step, state)
      if not preempted and cfg.final_eval:
        eval_loss = run_eval(step, state.params)
    checkpointer.wait()
    if preempted:
      writer.info(f"Preempted: saved step {step} in {checkpointer.directory}; run the "
                  "same command again to resume.")
      return RunResult(step, True, None, None)
    sample_text = None
    if cfg.sample_prompt:
      # Outside the activation context: a one-sequence batch is not split over devices.
      from pretrain import sample as sample_lib  # pylint: disable=g-import-not-at-top
      sample_text = sample_lib.sample_text(
          model_cfg, state.params, pipeline.vocabulary, cfg.sample_prompt,
          max_new_tokens=cfg.sample_tokens, temperature=0.8, seed=cfg.seed)
      writer.info(f"Sample:\n{cfg.sample_prompt}{sample_text}")
    writer.info(f"Done: {step} steps in {time.perf_counter() - loop_start:.1f}s"
                + (f", validation loss {eval_loss:.4f}" if eval_loss is not None else ""))
    return RunResult(step, False, eval_loss, sample_text)
  finally:
    checkpointer.close()
    writer.close()


def build_pipeline(train_config: TrainConfig, setup: Setup) -> Any:
  """The Gin-configured `DataPipeline`, feeding this process's rows of each batch.

  Batch size, sequence length and seed come from `TrainConfig`, so the model and the
  data can never disagree on them.
  """
  from pretrain.data import pipeline as pipeline_lib  # pylint: disable=g-import-not-at-top
  rows = partition.process_batch_rows(setup.mesh, train_config.batch_size, setup.rules)
  count, index = jax.process_count(), jax.process_index()
  per_process = train_config.batch_size // count
  if rows != slice(index * per_process, (index + 1) * per_process):
    raise UserError(
        f"The mesh gives process {index} batch rows {rows.start}:{rows.stop}, but the "
        f"data pipeline feeds rows {index * per_process}:{(index + 1) * per_process}; "
        "order the mesh so the batch axes split processes evenly")
  pipeline = pipeline_lib.DataPipeline(
      sequence_length=train_config.sequence_length, batch_size=train_config.batch_size,
      seed=train_config.seed, process_index=index, process_count=count)
  return pipeline
