"""The training run: a `Trainer` whose loop steps and hands everything else to hooks.

One jitted `train_step(state, batch) -> (state, metrics)` does the whole update
(`pretrain.steps`); the state is donated and every array lives in the sharded layout of
the `Runtime`. The loop never waits for the device to report: step s's metrics are
fetched after step s+1 has been dispatched, checkpoints are written by Orbax in the
background, and only hooks that are due look at values at all (`pretrain.hooks`).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import shlex
import sys
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from model import counting
from plumbing import quiet
from plumbing.errors import (CheckpointSaveStop, StorageOutageError, StorageOutageStop,
                             UserError, usage_error, warn)
from pretrain.evaluation import downstream
from pretrain.evaluation import loss as evaluation
from pretrain.observability import flops as flops_lib
from pretrain.evaluation import generation
from pretrain.observability import goodput
from pretrain import hooks as hooks_lib
from pretrain.observability import stragglers
from pretrain.observability import watchdog as watchdog_lib
from pretrain.checkpoints.tier import CheckpointTier
from pretrain.checkpoints.checkpointer import Checkpointer
from pretrain.checkpoints.policies import Snapshot
from pretrain.checkpoints.saving import CheckpointHook
from pretrain.data.vocabularies import token_byte_lengths
from pretrain.checkpoints.metadata import RunMetadata, vocabulary_spec
from pretrain.observability.metrics import MetricsWriter, format_duration
from pretrain.observability.trackers import run_info as tracker_run_info
from pretrain.optimizer import OptimizerConfig, learning_rate_schedule, model_optimizer
from pretrain.checkpoints.outage import FLUSH_TIMEOUT_S, StorageConfig
from pretrain.run_directory import RunDirectory
from pretrain.runtime import Runtime, host_scalar
from pretrain.steps import TrainState, jit_train_step
from pretrain.train_config import TrainConfig
from sharding import partition


class Pipeline(Protocol):
  """What the trainer needs of its input pipeline (`pretrain.data.DataPipeline`; any
  object with these members will do).

  Attributes:
    vocabulary: the SeqIO vocabulary of the token ids (byte, SentencePiece or
      pass-through: what checkpoint metadata can record).
    vocab_size: the number of ids the data uses (at most `ModelConfig.vocab_size`).
  """
  vocabulary: Any
  vocab_size: int

  def batch(self, step: int) -> Mapping[str, np.ndarray]:
    """This process's rows of global batch `step` (docs/INTERNALS.md, "Data"), a pure
    function of the step."""

  def validation_batches(self, max_batches: Optional[int] = None
                         ) -> Iterable[Mapping[str, np.ndarray]]:
    """This process's rows of the validation batches, in order (padding rows: weight 0)."""

  def describe(self) -> str:
    """One line about the data, printed at start-up."""


@dataclasses.dataclass
class RunResult:
  """What a finished (or preempted) run reports.

  Attributes:
    results: what the hooks reported (`Hook.results`), merged: `train_loss`,
      `eval_loss`, `sample` and whatever added hooks report.
  """
  last_step: int
  preempted: bool
  final_eval_loss: Optional[float]
  sample: Optional[str]
  results: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class _PendingMetrics:
  """Device metrics of dispatched steps, fetched one step late and handed to hooks."""

  def __init__(self, hooks: Sequence[hooks_lib.Hook]):
    self._hooks = hooks
    self._queue: collections.deque = collections.deque()
    self.fetched: Optional[int] = None   # the newest step whose metrics were fetched

  def push(self, step: int, metrics: Mapping[str, jax.Array]) -> None:
    """Queues step `step`; fetches the previous one, which has finished by now."""
    self._queue.append((step, metrics))
    while len(self._queue) > 1:
      self._fetch(*self._queue.popleft())

  def drain(self) -> None:
    while self._queue:
      self._fetch(*self._queue.popleft())

  def _fetch(self, step: int, metrics: Mapping[str, jax.Array]) -> None:
    values = {name: host_scalar(value) for name, value in metrics.items()}
    self.fetched = step
    for hook in self._hooks:
      hook.on_metrics(step, values)


class Trainer:
  """Runs the training loop of one run from its parts.

  Args:
    run: the run directory (where each part of the run goes).
    config: the TrainConfig.
    runtime: model, mesh and shardings.
    optimizer_config: AdamW and schedule settings.
    pipeline: the input pipeline (`Pipeline`).
    checkpointer: where state is saved and restored (every tier).
    writer: metrics and console output.
    clock: books the session's wall time (`pretrain.observability.goodput`); a new one by default.
  """

  def __init__(self, run: RunDirectory, config: TrainConfig, runtime: Runtime,
               optimizer_config: OptimizerConfig, pipeline: Pipeline,
               checkpointer: Checkpointer, writer: MetricsWriter,
               clock: Optional[goodput.GoodputClock] = None):
    self.run_directory = run
    self.config = config
    self._added_hooks: list[hooks_lib.Hook] = []
    self.clock = clock or goodput.GoodputClock()
    self.runtime = runtime
    self.pipeline = pipeline
    self.checkpointer = checkpointer
    self.writer = writer
    self.optimizer = model_optimizer(optimizer_config, config.train_steps, runtime.config,
                                     runtime.abstract_params)
    program = jit_train_step(runtime, self.optimizer,
                             learning_rate_schedule(optimizer_config, config.train_steps),
                             config.microbatches, config.z_loss_weight,
                             config.loss_chunks)
    self.abstract_opt_state = program.abstract_state.opt_state
    self.state_shardings = program.state_shardings
    self.flops_per_token = flops_lib.training_flops_per_token(runtime.config,
                                                              config.sequence_length)
    self.train_step = program.step
    self._eval_step = evaluation.jit_eval_step(
        runtime, token_byte_lengths(pipeline.vocabulary, runtime.config.vocab_size))
    # Loads the tasks now, so that an unknown one stops the run before its first step.
    self.downstream = downstream.DownstreamEvaluation(
        config.downstream_tasks, runtime, pipeline.vocabulary,
        max_length=config.sequence_length, batch_size=config.batch_size,
        include_path=config.downstream_include_path,
        limit=config.downstream_limit) if config.downstream_tasks else None
    self.watchdog = watchdog_lib.Watchdog(
        config.hang_timeout_s, long_s=config.hang_long_s,
        stacks_dir=run.hangs,
        process_index=jax.process_index(), multi_process=jax.process_count() > 1)

  def initial_state(self) -> tuple[TrainState, jax.Array, Optional[CheckpointTier]]:
    """The newest good checkpoint's state and RNG (of any tier), or a fresh start;
    and the tier it came from (None when fresh). Each checkpoint skipped because it is
    unreadable is one line; when none is left to resume from, the run stops rather
    than start afresh on its own."""
    init_opt = jax.jit(self.optimizer.init, out_shardings=self.state_shardings.opt_state)
    restored, skipped = self.checkpointer.restore_newest(
        abstract_params=self.runtime.abstract_params,
        abstract_opt_state=self.abstract_opt_state)
    for unreadable in skipped:
      if unreadable.detail is not None:  # the process that found it tells
        warn(f"{unreadable}: " + (f"resuming from {restored.step}" if restored
                                  else "set aside"))
    if restored is None and skipped:
      raise UserError(f"No readable checkpoint is left in "
                      f"{self.run_directory.checkpoints} (the unreadable ones are kept as "
                      "<step>.corrupt-<problem>); run the same command again to start "
                      "afresh")
    if restored is None:
      params = self.runtime.init_params(self.config.seed)
      self.writer.info(f"Starting a new run in {self.run_directory.root}")
      return (self._state(0, params, init_opt(params)), jax.random.key(self.config.seed),
              None)
    opt_state = restored.opt_state
    if opt_state is None:  # a converted checkpoint: weights only
      opt_state = init_opt(restored.params)
    self.writer.info(f"Resuming from the {restored.tier.describe(restored.step)}")
    rng = restored.rng if restored.rng is not None else jax.random.key(self.config.seed)
    return self._state(restored.step, restored.params, opt_state), rng, restored.tier

  def _state(self, step: int, params: Any, opt_state: Any) -> TrainState:
    return TrainState(jax.device_put(jnp.int32(step), self.runtime.replicated), params,
                      opt_state)

  def default_hooks(self, start_step: int, rng: jax.Array) -> list[hooks_lib.Hook]:
    """Divergence check, logging, preemption, checkpoints, evaluation, downstream
    tasks and sampling, for a run starting at `start_step` (the Checkpointer knows
    which tier it was restored from)."""
    cfg = self.config
    metadata = RunMetadata(self.runtime.config,
                           vocabulary_spec(self.pipeline.vocabulary,
                                           self.run_directory.root),
                           cfg.sequence_length)
    hooks = [
        hooks_lib.DivergenceCheck(self.checkpointer),
        hooks_lib.MetricsLogger(
            self.writer, log_every=cfg.log_every, start_step=start_step,
            tokens_per_step=cfg.batch_size * cfg.sequence_length,
            flops_per_token=self.flops_per_token, log_z_loss=bool(cfg.z_loss_weight)),
        hooks_lib.PreemptionHook(start_step),
        CheckpointHook(self.checkpointer, rng=rng, metadata=metadata.to_json(),
                       writer=self.writer),
        hooks_lib.EvalHook(self.evaluate, self.writer, every=cfg.eval_every,
                           final_eval=cfg.final_eval, train_steps=cfg.train_steps),
    ]
    if self.downstream is not None:
      hooks.append(hooks_lib.DownstreamHook(
          self.downstream, self.writer, every=cfg.downstream_every,
          final_eval=cfg.final_eval, train_steps=cfg.train_steps))
    if jax.process_count() > 1:
      hooks.append(stragglers.StragglerHook(self.watchdog, self.writer,
                                            every=cfg.log_every))
    if cfg.sample_prompt:
      hooks.append(hooks_lib.SampleHook(self.sample, cfg.sample_prompt, self.writer))
    if cfg.profile_steps and (cfg.profile_all_processes or jax.process_index() == 0):
      hooks.append(hooks_lib.ProfileHook(self.run_directory.profile, *cfg.profile_steps,
                                         start_step=start_step))
    return hooks

  def add_hook(self, hook: Union[hooks_lib.Hook, hooks_lib.StepCallback],
               every: Optional[int] = None) -> hooks_lib.Hook:
    """Adds a hook that `run` calls after the default ones; returns it.

    Args:
      hook: a `pretrain.hooks.Hook`, or a function of one `pretrain.hooks.StepInfo`.
      every: run its `on_step` (the function) every this many steps; for a Hook, None
        keeps its own `every`; for a function, None means every step.
    """
    if not isinstance(hook, hooks_lib.Hook):
      hook = hooks_lib.CallbackHook(hook, 1 if every is None else every)
    elif every is not None:
      hook.every = every
    self._added_hooks.append(hook)
    return hook

  def evaluate(self, params: Any) -> dict[str, float]:
    """Validation loss, token count and bits per byte (`evaluation.evaluate_batches`)
    of `params` on the configured batches."""
    return evaluation.evaluate_batches(
        self.runtime, params, self.pipeline.validation_batches(self.config.eval_batches),
        self._eval_step)

  def sample(self, params: Any) -> str:
    """A continuation of the configured prompt (one sequence, unsharded batch)."""
    cfg = self.config
    return generation.sample_text(self.runtime.config, params, self.pipeline.vocabulary,
                                  cfg.sample_prompt, max_new_tokens=cfg.sample_tokens,
                                  temperature=0.8, seed=cfg.seed)

  def _resume_accounting(self, start_step: int, tier: Optional[CheckpointTier]) -> None:
    """Drops the metric rows past the restored step and books the steps to be redone
    (and the downtime before this session) to the goodput clock; logs which steps are
    redone as a `restart` row."""
    dropped = self.writer.rewind(start_step)
    restart = self.clock.resume(start_step, tier.name if tier else None,
                                self.writer.read_rows(), dropped)
    if restart is not None:
      self.writer.log_record(restart)
      if restart["lost_steps"]:
        self.writer.info(f"Redoing steps {restart['redone_from']}-{restart['redone_to']} "
                         f"(run before the restart, after the newest checkpoint)")

  def _log_mixture_shares(self, step: int) -> None:
    """A mixture's realized token shares over the batches since the last log step
    (`pretrain.data.mixing`), written before the hooks run, so a checkpoint of `step`
    is never on disk without its record."""
    mixture_record = getattr(self.pipeline, "mixture_record", None)
    record = mixture_record(step) if mixture_record else None
    if record:
      self.writer.log_record(record)

  def _recount_mixture_batches(self, start_step: int) -> None:
    """On resume at a step between two log steps: the mixture's counts take in the
    batches since the last log step again, so the first record after a restart is the
    one an uninterrupted run writes."""
    recount = getattr(self.pipeline, "recount_mixture_batches", None)
    if recount:
      recount(range(start_step - start_step % self.config.log_every, start_step))

  def run(self) -> RunResult:
    """Trains from the newest checkpoint (or from scratch) to `train_steps`, with the
    default hooks and those added (`add_hook`), under the hang watchdog unless
    `hang_timeout_s` is 0."""
    if self.config.hang_timeout_s != 0:
      self.watchdog.start()
    try:
      return self._run()
    finally:
      self.watchdog.stop()

  def _run(self) -> RunResult:
    clock, watchdog = self.clock, self.watchdog
    restore_started = time.perf_counter()
    state, rng, tier = self.initial_state()
    clock.seconds["restore" if tier else "startup"] += time.perf_counter() - restore_started
    step = start_step = int(host_scalar(state.step))
    self._resume_accounting(start_step, tier)
    self._recount_mixture_batches(start_step)
    hooks = self.default_hooks(start_step, rng) + self._added_hooks
    pending = _PendingMetrics(hooks)
    started = time.perf_counter()
    try:
      with self.runtime.activation_context():
        while step < self.config.train_steps and not any(h.stop_requested for h in hooks):
          with clock.timed("data"), watchdog.phase("data"):
            batch = self.runtime.global_batch(self.pipeline.batch(step))
          # The first call traces and compiles before it dispatches the step.
          with (clock.timed("compile") if step == start_step else contextlib.nullcontext(),
                watchdog.phase("step")):
            state, metrics = self.train_step(state, batch)
          step += 1
          with watchdog.phase(watchdog.wait_phase):  # the previous step's metrics
            pending.push(step, metrics)
          if step % self.config.log_every == 0:
            self._log_mixture_shares(step)
          due = [hook for hook in hooks if hook.is_due(step)]
          if any(hook.drains_metrics for hook in due):
            with watchdog.phase(watchdog.wait_phase):
              pending.drain()
          if pending.fetched is not None:   # its results reached the host
            watchdog.step_done(pending.fetched)
          for hook in due:
            with clock.timed(hook.goodput_category), watchdog.phase(hook.goodput_category):
              hook.on_step(step, state)
          if due:
            watchdog.paused()
          if any(hook.drains_metrics for hook in due):
            for hook in hooks:
              hook.resumed(step)
          if step % self.config.log_every == 0:
            self.writer.log_record(clock.row(step))
        with watchdog.phase(watchdog.wait_phase):
          pending.drain()
      preempted = step < self.config.train_steps
      for hook in hooks:
        with clock.timed(hook.goodput_category), watchdog.phase(hook.goodput_category):
          hook.on_end(step, state, preempted)
    except StorageOutageError as outage:
      raise self._stop_for_outage(outage, step, state, rng) from None
    except CheckpointSaveStop as failure:
      raise self._stop_after_failed_save(failure, step, state, rng) from None
    finally:
      for hook in hooks:
        hook.close()
    self.writer.log_record(clock.row(step))
    totals = goodput.run_totals(self.writer.read_rows())
    if totals is not None:
      self.writer.info(goodput.format_totals(totals))
    return self._result(step, preempted, hooks, time.perf_counter() - started)

  def _stop_for_outage(self, outage: StorageOutageError, step: int, state: TrainState,
                       rng: jax.Array) -> StorageOutageStop:
    """The error that stops a run whose bucket has been unreachable for longer than
    `StorageConfig.outage_s`, once `step` is saved to the best-effort tiers (the
    local one, when configured): a rerun resumes from it."""
    saved = self._save_best_effort(step, state, rng)
    where = (f"saved the {' and the '.join(saved)}" if saved else
             "no local tier to save to (CheckpointConfig.local_dir): the steps after the "
             "newest persistent checkpoint are lost")
    return StorageOutageStop(f"{outage}; {where}; stopped: run the same command again "
                             "once the storage answers")

  def _stop_after_failed_save(self, failure: CheckpointSaveStop, step: int,
                              state: TrainState, rng: jax.Array) -> CheckpointSaveStop:
    """`failure` (an essential tier's save failed twice) once `step` is saved to the
    best-effort tiers, when there are any: a rerun resumes from there rather than from
    the newest essential checkpoint."""
    saved = self._save_best_effort(step, state, rng)
    if not saved:
      return failure
    return CheckpointSaveStop(f"{failure}; saved the {' and the '.join(saved)}: a rerun "
                              "resumes from it")

  def _save_best_effort(self, step: int, state: TrainState, rng: jax.Array) -> list[str]:
    """Saves `step` to the best-effort tiers and waits for it, the last thing a run that
    stops for its storage does; returns where it is saved."""
    with self.watchdog.phase("checkpoint"):
      return self.checkpointer.save_best_effort_now(
          step, Snapshot(state.params, state.opt_state, rng, metadata={}))

  def _result(self, step: int, preempted: bool, hooks: Sequence[hooks_lib.Hook],
              seconds: float) -> RunResult:
    results: dict[str, Any] = {}
    for hook in hooks:
      results.update(hook.results())
    eval_loss = results.get("eval_loss")
    if not preempted:
      self.writer.info(end_summary(
          self.run_directory.root, step,
          self.config.batch_size * self.config.sequence_length, seconds,
          results.get("train_loss"), eval_loss, str(self.run_directory.checkpoints)))
    return RunResult(step, preempted, None if preempted else eval_loss,
                     results.get("sample"), results)


def start_summary(workdir: str, config: TrainConfig, runtime: Runtime) -> str:
  """Where and how the run trains: devices, processes, mesh, tokens per step, workdir."""
  devices = jax.devices()
  mesh = ", ".join(f"{axis} {size}" for axis, size in runtime.mesh.shape.items())
  return (f"run: {len(devices)} {devices[0].platform} device(s) in {jax.process_count()} "
          f"process(es); mesh {mesh}; batch {config.batch_size} x "
          f"{config.sequence_length} = {config.batch_size * config.sequence_length:,} "
          f"tokens/step; workdir {workdir}")


def end_summary(workdir: str, step: int, tokens_per_step: int, seconds: float,
                train_loss: Optional[float], eval_loss: Optional[float],
                checkpoints: str) -> str:
  """What the run did and what to run next."""
  losses = ", ".join(
      f"{name} {value:.4f}" for name, value in (("train loss", train_loss),
                                                ("validation loss", eval_loss))
      if value is not None)
  quoted = shlex.quote(workdir)
  return (f"Done: {step} steps, {step * tokens_per_step:,} tokens; this session "
          f"{format_duration(seconds)}" + (f"; {losses}" if losses else "") +
          f"\ncheckpoints: {checkpoints} (newest: step {step})\nnext: python -m "
          f"pretrain.evaluate --workdir={quoted}\n      python -m pretrain.sample "
          f"--workdir={quoted} --prompt='...'")


def train(run: RunDirectory, config: TrainConfig, runtime: Runtime,
          optimizer_config: OptimizerConfig, checkpointer: Checkpointer,
          pipeline_factory: Callable[[TrainConfig, Runtime], Pipeline],
          on_ready: Optional[Callable[[], None]] = None,
          hooks: Sequence[Union[hooks_lib.Hook, hooks_lib.StepCallback]] = (),
          storage_config: StorageConfig = StorageConfig()) -> RunResult:
  """Trains (or resumes) the run in `run` from explicit configs.

  Args:
    run: the run directory (metrics, trackers, hang dumps, profiles; the checkpoints
      are the tiers of `checkpointer`).
    config, runtime, optimizer_config: the run's settings.
    checkpointer: the run's Checkpointer (closed when the run ends).
    pipeline_factory: builds the input pipeline for (config, runtime).
    on_ready: called once everything is configured, before the first step (the CLI
      writes the operative Gin config there).
    hooks: added to the default hooks (`Trainer.add_hook`: Hooks with their own
      `every`, functions of a `StepInfo` every step).
    storage_config: how long a bucket workdir may be unreachable (`pretrain.checkpoints.outage`).
  """
  clock = goodput.GoodputClock()
  if not quiet.verbose_requested(sys.argv):
    quiet.keep_client_logs(run.client_log)
  writer = MetricsWriter(run.root, config.train_steps, trackers=config.trackers,
                         storage_config=storage_config, unsent_path=run.unsent_metrics,
                         tracker_exit_wait_s=config.tracker_exit_wait_s)
  flush_timeout_s, failed = FLUSH_TIMEOUT_S, True
  try:
    with clock.timed("startup"):
      trainer = _build_trainer(run, config, runtime, optimizer_config, checkpointer,
                               pipeline_factory, writer, clock)
    for hook in hooks:
      trainer.add_hook(hook)
    if on_ready is not None:
      on_ready()
    writer.start_trackers(tracker_run_info.describe_run(
        run.root, config.tracker_group, (config, runtime.config, optimizer_config),
        tracker_run_info.model_facts(
            runtime.config, sequence_length=config.sequence_length,
            batch_size=config.batch_size, train_steps=config.train_steps,
            flops_per_token=trainer.flops_per_token)))
    result = trainer.run()
    failed = False
    return result
  except StorageOutageStop:
    flush_timeout_s = 0.0   # the writes still queued go to the storage that is down
    raise
  finally:
    checkpointer.close()
    writer.close(flush_timeout_s, failed)


def _build_trainer(run: RunDirectory, config: TrainConfig, runtime: Runtime,
                   optimizer_config: OptimizerConfig, checkpointer: Checkpointer,
                   pipeline_factory: Callable[[TrainConfig, Runtime], Pipeline],
                   writer: MetricsWriter, clock: goodput.GoodputClock) -> Trainer:
  """The pipeline and the Trainer, after the checks that must fail before any step."""
  pipeline = pipeline_factory(config, runtime)
  if runtime.config.vocab_size < pipeline.vocab_size:
    raise usage_error(
        f"ModelConfig.vocab_size={runtime.config.vocab_size} is smaller than the data's "
        f"vocabulary ({pipeline.vocab_size} ids); set ModelConfig.vocab_size >= "
        f"{pipeline.vocab_size}")
  trainer = Trainer(run, config, runtime, optimizer_config, pipeline, checkpointer, writer,
                    clock)
  writer.info(start_summary(run.root, config, runtime))
  writer.info(pipeline.describe())
  writer.info(f"model: {counting.count_params(runtime.config).total:,} parameters, "
              f"{trainer.flops_per_token:,.0f} training FLOPs/token")
  if config.print_sharding:
    writer.info(partition.format_sharding_table(runtime.abstract_params,
                                                runtime.param_shardings))
  # A checkpoint of another model fails before anything is written.
  checkpointer.check_newest_matches(runtime.abstract_params, runtime.config)
  return trainer
