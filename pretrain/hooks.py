"""What the training loop does besides stepping, one hook each, every N steps.

The loop (`pretrain.trainer.Trainer.run`) calls, in order:
  `on_metrics(step, values)`  for every step, one step late, once its metrics reach the
                              host (logging, divergence checks);
  `on_step(step, state)`      when `step % every == 0` (checkpoints, evaluation,
                              preemption); before a hook with `drains_metrics` runs,
                              every earlier step's metrics have been checked, so no
                              state is saved or evaluated after a diverged step;
  `resumed(step)`             after the loop paused at `step` for such hooks;
  `on_end(step, state, preempted)`  once, after the last step (final save, final
                              evaluation, sample);
  `close()`                   always, also when training failed.
A hook asks the loop to stop after the current step by setting `stop_requested`, and
reports what the run's result should carry through `results()` (the train loss, the
validation loss, the sample; `Trainer.run` merges them into `RunResult.results`).
Each hook is a small object with no reference to the loop, so it can be tested alone.
A plain function of one `StepInfo` record becomes a hook with `CallbackHook`
(`Trainer.add_hook(fn, every=N)`).
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Optional

import jax
from jax.experimental import multihost_utils

from plumbing import storage
from plumbing.errors import CheckpointSaveError, TrainingDivergedError
from pretrain.checkpoints.checkpointer import Checkpointer
from pretrain.hook_interface import Hook, StepCallback, StepInfo  # noqa: F401  (for hook authors)
from pretrain.observability import flops as flops_lib
from pretrain.observability.metrics import MetricsWriter, StepTimer
from pretrain.steps import TrainState


class CallbackHook(Hook):
  """Runs `callback(StepInfo)` every `every` steps, once that step's metrics are on the
  host (the loop fetches them before running the hook). Its time counts as `other`."""

  def __init__(self, callback: StepCallback, every: int):
    if every < 1:
      raise ValueError(f"a hook's interval must be >= 1, got {every}")
    self.every = every
    self._callback = callback
    self._metrics: Mapping[str, float] = {}

  def on_metrics(self, step: int, values: Mapping[str, float]) -> None:
    del step
    self._metrics = values

  def on_step(self, step: int, state: TrainState) -> None:
    self._callback(StepInfo(step, state, self._metrics))


class DivergenceCheck(Hook):
  """Stops the run at the first step whose loss or norms are NaN or infinite.

  It raises before any later state is saved, so the newest checkpoint is a good one.
  """
  WATCHED = ("loss", "grad_norm", "param_norm")

  def __init__(self, checkpointer: Checkpointer):
    self._checkpointer = checkpointer

  def on_metrics(self, step: int, values: Mapping[str, float]) -> None:
    if all(math.isfinite(values[name]) for name in self.WATCHED):
      return
    try:
      self._checkpointer.wait()
    except CheckpointSaveError:
      pass  # that step is not among the good checkpoints named below
    good = self._checkpointer.newest_good()
    where = (f"the newest good checkpoint (step {good[0]}) is intact in {good[1]}"
             if good is not None else "no checkpoint was written")
    raise TrainingDivergedError(
        f"Training diverged at step {step}: loss={values['loss']}, "
        f"grad_norm={values['grad_norm']}, param_norm={values['param_norm']}; stopped "
        f"without saving, {where}. Lower OptimizerConfig.peak_learning_rate or "
        "clip_norm, or raise warmup_steps.")


class MetricsLogger(Hook):
  """Writes a metrics row and a console line every `log_every` steps (and the first).

  Throughput is measured between two fetched steps, so it covers whole steps of device
  work; the time the loop spends in other hooks (evaluation, saves) is left out.

  Attributes:
    last_loss: the training loss of the newest step seen (None before the first).
  """
  last_loss: Optional[float] = None

  def __init__(self, writer: MetricsWriter, *, log_every: int, start_step: int,
               tokens_per_step: int, flops_per_token: float, log_z_loss: bool = False):
    self._writer = writer
    self._log_every = log_every
    self._start_step = start_step
    self._tokens_per_step = tokens_per_step
    self._flops_per_token = flops_per_token
    self._log_z_loss = log_z_loss
    self._timer = StepTimer()
    self._started = time.perf_counter()

  def on_metrics(self, step: int, values: Mapping[str, float]) -> None:
    self.last_loss = values["loss"]
    if step % self._log_every and step != self._start_step + 1:
      return
    step_time = self._timer.mark(step)
    if step_time is None:  # first logged step: includes compilation
      step_time = (time.perf_counter() - self._started) / (step - self._start_step)
    tokens_per_second = self._tokens_per_step / step_time
    row = {name: values[name]
           for name in ("loss", "learning_rate", "grad_norm", "param_norm")}
    row.update(tokens_per_second=tokens_per_second, step_time_s=step_time,
               mfu=flops_lib.mfu(tokens_per_second, self._flops_per_token))
    if self._log_z_loss:
      row["z_loss"] = values["z_loss"]
    self._writer.log_train(step, row)

  def resumed(self, step: int) -> None:
    self._timer.restart(step)

  def results(self) -> Mapping[str, Any]:
    return {"train_loss": self.last_loss}


class _PeriodicEvaluation(Hook):
  """Runs `evaluate(params)` every `every` steps and, unless preempted, once after the
  last step (`final_eval`); subclasses write the result (`_write`)."""
  goodput_category = "eval"

  def __init__(self, evaluate: Callable[[Any], Mapping[str, float]], writer: MetricsWriter,
               *, every: int, final_eval: bool, train_steps: int):
    self.every = every
    self._evaluate = evaluate
    self._writer = writer
    self._final_eval = final_eval
    self._train_steps = train_steps

  def _write(self, step: int, result: Mapping[str, float]) -> None:
    raise NotImplementedError

  def on_step(self, step: int, state: TrainState) -> None:
    if not (self._final_eval and step == self._train_steps):  # on_end evaluates it
      self._write(step, self._evaluate(state.params))

  def on_end(self, step: int, state: TrainState, preempted: bool) -> None:
    if self._final_eval and not preempted:
      self._write(step, self._evaluate(state.params))


class EvalHook(_PeriodicEvaluation):
  """Validation loss rows: `evaluate(params)` returns {"loss", "tokens"} and, where the
  vocabulary has text, "bits_per_byte" (`pretrain.evaluation.loss.evaluate_batches`).

  Attributes:
    last_loss: the newest validation loss (None before the first evaluation).
  """
  last_loss: Optional[float] = None

  def _write(self, step: int, result: Mapping[str, float]) -> None:
    self.last_loss = result["loss"]
    self._writer.log_eval(step, result["loss"], result["tokens"],
                          result.get("bits_per_byte"))

  def results(self) -> Mapping[str, Any]:
    return {"eval_loss": self.last_loss}


class DownstreamHook(_PeriodicEvaluation):
  """Downstream-task rows (`downstream/<task>/<metric>`) of the live parameters."""

  def _write(self, step: int, result: Mapping[str, float]) -> None:
    self._writer.log_downstream(step, result)


class ProfileHook(Hook):
  """Captures a JAX profiler trace of optimizer steps `first`..`last` into `logdir`.

  The trace starts before step `first` is dispatched and stops once step `last` has
  finished on the device (the state is awaited), so the trace holds exactly those steps'
  device work; TensorBoard's profile plugin (or xprof) reads `logdir`. A run resumed
  inside the window traces from its first step to `last`. JAX writes traces to local
  disk only: for a `gs://` / `s3://` logdir the trace goes to a local staging directory
  and is uploaded to `logdir` when it stops.
  """
  drains_metrics = False

  def __init__(self, logdir: str, first: int, last: int, start_step: int):
    self._destination = logdir
    self._logdir = tempfile.mkdtemp(prefix="griffin_profile_") if storage.is_url(logdir) \
        else logdir
    self._first, self._last = first, last
    self._tracing = False
    if start_step + 1 >= first and start_step < last:
      self._start()

  def is_due(self, step: int) -> bool:
    return step in (self._first - 1, self._last)

  def on_step(self, step: int, state: TrainState) -> None:
    if step == self._first - 1 and not self._tracing:
      self._start()
    elif step == self._last and self._tracing:
      jax.block_until_ready(state)
      self._stop()

  def close(self) -> None:
    if self._tracing:
      self._stop()

  def _start(self) -> None:
    jax.profiler.start_trace(self._logdir)
    self._tracing = True
    logging.info("profiling steps %d..%d into %s", self._first, self._last, self._logdir)

  def _stop(self) -> None:
    jax.profiler.stop_trace()
    self._tracing = False
    if self._logdir != self._destination:
      storage.upload_tree(self._logdir, self._destination)
      shutil.rmtree(self._logdir, ignore_errors=True)


class PreemptionHook(Hook):
  """Stops the run at a step boundary on SIGTERM or Ctrl-C; the final save follows.

  Ctrl-C (SIGINT) means the same as a preemption notice: save the current step, exit 0,
  rerun to resume. A second Ctrl-C kills the process at once (the default action is
  restored after the first), for when the save itself is not wanted.

  With one process Python handlers set a flag. With several, each host gets its own
  notice at its own moment, and a host that stopped alone would leave the others
  blocked in the next step's collectives; so the decision goes through JAX's preemption
  sync service, which catches SIGTERM itself (from `jax.distributed.initialize` on) and
  lets every process agree on the first step all of them can still reach. There, Ctrl-C
  is turned into a SIGTERM to this process, so it takes the same agreed path.

  The service agrees on "the largest number any process last asked about, plus one",
  and a process that has not asked yet counts as 0. So it is asked with the number of
  steps this session has trained, never the global step: a notice that arrives while a
  resumed run restores or compiles then agrees on the session's first step, where the
  global step would agree on step 1, which a run resumed at step 5 never reaches. This
  hook is its only caller (`pretrain.checkpoints.orbax_manager`).
  """
  every = 1
  drains_metrics = False

  def __init__(self, start_step: int):
    self._start_step = start_step
    self._multi_process = jax.process_count() > 1
    self._previous_handlers: dict[int, Any] = {}
    watched = (signal.SIGINT,) if self._multi_process else (signal.SIGINT, signal.SIGTERM)
    for signum in watched:
      try:
        self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
      except ValueError:  # not the main thread: no handler, no preemption saves
        break

  def _on_signal(self, signum: int, frame: Any) -> None:
    del frame
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C aborts at once
      print("\nCtrl-C: saving the current step, then stopping (Ctrl-C again aborts "
            "without saving)", file=sys.stderr, flush=True)
      if self._multi_process:
        os.kill(os.getpid(), signal.SIGTERM)  # the preemption sync service's notice
        return
    else:
      logging.warning("Received signal %d: saving a checkpoint and stopping", signum)
    self.stop_requested = True

  def on_step(self, step: int, state: TrainState) -> None:
    del state
    if (self._multi_process and
        multihost_utils.reached_preemption_sync_point(step - self._start_step)):
      logging.warning("Preemption notice: all processes save step %d and stop", step)
      self.stop_requested = True

  def close(self) -> None:
    for signum, handler in self._previous_handlers.items():
      signal.signal(signum, handler)
    self._previous_handlers = {}


class SampleHook(Hook):
  """Prints a continuation of a prompt after a finished (not preempted) run.

  Attributes:
    text: the sampled continuation (None until sampled).
  """
  goodput_category = "eval"

  def __init__(self, sample: Callable[[Any], str], prompt: str, writer: MetricsWriter):
    self._sample = sample
    self._prompt = prompt
    self._writer = writer
    self.text: Optional[str] = None

  def on_end(self, step: int, state: TrainState, preempted: bool) -> None:
    if not preempted:
      self.text = self._sample(state.params)
      self._writer.info(f"Sample:\n{self._prompt}{self.text}")

  def results(self) -> Mapping[str, Any]:
    return {"sample": self.text}
