"""How long and how to train: `TrainConfig`, the run's plain config that Gin binds.

Apart from the trainer so that what only reads the config (the Gin loader,
`pretrain.data.prepare` for the sequence length, the compilers and the memory plan) does
not import the training loop.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from pretrain.observability import trackers as trackers_lib
from pretrain.observability.trackers import delivery
from pretrain.observability import watchdog as watchdog_lib


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
    loss_chunks: form the float32 logits in this many token chunks, forward and
      backward, instead of all [B, T, V] at once (`pretrain.losses`; same loss). For
      large vocabularies; must divide sequence_length.
    eval_batches: validation batches per evaluation (None: the whole split).
    final_eval: evaluate once more after the last step.
    sample_prompt: if set, print a sample continuing this prompt after training.
    sample_tokens: new tokens of that sample.
    print_sharding: log the parameter sharding table at start-up.
    profile_steps: (first, last) optimizer steps to capture in a JAX profiler trace
      under `<workdir>/profile` (TensorBoard's profile plugin reads it); None: none.
    profile_all_processes: trace every process, not only process 0.
    downstream_tasks: lm-evaluation-harness tasks (or groups) to score the live
      parameters on (`pretrain.evaluation.downstream`; needs the `eval` extra), written as
      `downstream/<task>/<metric>` metrics; () for none.
    downstream_every: run them every this many steps; 0: only after the last step
      (with `final_eval`).
    downstream_include_path: a directory of lm_eval YAML tasks, as lm_eval's
      `--include_path`.
    downstream_limit: score at most this many examples of each task (None: all).
    hang_timeout_s: a process whose current phase (data, step, collective, ...) makes
      no progress for this many seconds dumps its Python stacks and exits with code 1,
      so the launcher restarts the run (`pretrain.observability.watchdog`); None derives it from the
      run: 10 x the median step time, at least 120 s; 0 turns the watchdog off.
    hang_long_s: the allowance before the first step completes (restore, compilation)
      and of evaluations and checkpoint waits.
    trackers: the experiment trackers that get every metrics row besides
      `metrics.jsonl` and the console, by registered name ("tensorboard", "wandb",
      "mlflow"; `pretrain.observability.trackers`); () for none.
    tracker_group: the study the run belongs to in the trackers (a W&B group, an MLflow
      experiment); `launch.sweep` sets it to the sweep's directory name.
    tracker_exit_wait_s: the longest the session's end waits for a tracker call that
      has had no answer (the rows it lacks are kept for the next session); a tracker
      slow to start, such as W&B's first `init` on a loaded machine, may need more
      than the default when sessions are only seconds long.
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
  loss_chunks: int = 1
  eval_batches: Optional[int] = 16
  final_eval: bool = True
  sample_prompt: Optional[str] = None
  sample_tokens: int = 200
  print_sharding: bool = False
  profile_steps: Optional[tuple[int, int]] = None
  profile_all_processes: bool = False
  downstream_tasks: tuple[str, ...] = ()
  downstream_every: int = 0
  downstream_include_path: Optional[str] = None
  downstream_limit: Optional[int] = None
  hang_timeout_s: Optional[float] = None
  hang_long_s: float = watchdog_lib.LONG_S
  trackers: tuple[str, ...] = ("tensorboard",)
  tracker_group: Optional[str] = None
  tracker_exit_wait_s: float = delivery.EXIT_WAIT_S

  def __post_init__(self):
    for name in ("train_steps", "batch_size", "sequence_length", "checkpoint_every",
                 "log_every", "microbatches", "sample_tokens", "loss_chunks"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"TrainConfig.{name} must be a positive integer, got {value!r}")
    if not self.tracker_exit_wait_s >= 0:
      raise ValueError("TrainConfig.tracker_exit_wait_s must be >= 0 seconds, got "
                       f"{self.tracker_exit_wait_s!r}")
    if self.eval_every < 0:
      raise ValueError(f"TrainConfig.eval_every must be >= 0, got {self.eval_every}")
    if self.batch_size % self.microbatches:
      raise ValueError(f"TrainConfig.batch_size={self.batch_size} must be divisible by "
                       f"microbatches={self.microbatches}")
    if self.sequence_length % self.loss_chunks:
      raise ValueError(f"TrainConfig.loss_chunks={self.loss_chunks} must divide "
                       f"sequence_length={self.sequence_length}")
    if self.z_loss_weight < 0:
      raise ValueError(f"TrainConfig.z_loss_weight must be >= 0, got {self.z_loss_weight}")
    if self.profile_steps is not None:
      steps = tuple(self.profile_steps)
      if len(steps) != 2 or not all(isinstance(s, int) for s in steps) or not (
          1 <= steps[0] <= steps[1]):
        raise ValueError(f"TrainConfig.profile_steps must be (first, last) steps with "
                         f"1 <= first <= last, got {self.profile_steps!r}")
    tasks = self.downstream_tasks
    if not isinstance(tasks, (tuple, list)) or not all(isinstance(t, str) and t
                                                       for t in tasks):
      raise ValueError("TrainConfig.downstream_tasks must be a tuple of lm_eval task "
                       f"names, e.g. ('hellaswag', 'arc_easy'), got {tasks!r}")
    object.__setattr__(self, "downstream_tasks", tuple(tasks))
    if self.downstream_every < 0:
      raise ValueError(f"TrainConfig.downstream_every must be >= 0, got "
                       f"{self.downstream_every}")
    if self.hang_timeout_s is not None and self.hang_timeout_s < 0:
      raise ValueError(f"TrainConfig.hang_timeout_s must be None or >= 0, got "
                       f"{self.hang_timeout_s}")
    if self.hang_long_s <= 0:
      raise ValueError(f"TrainConfig.hang_long_s must be > 0, got {self.hang_long_s}")
    if self.downstream_limit is not None and self.downstream_limit < 1:
      raise ValueError(f"TrainConfig.downstream_limit must be None or >= 1, got "
                       f"{self.downstream_limit}")
    if isinstance(self.trackers, str) or not isinstance(self.trackers, (tuple, list)):
      raise ValueError("TrainConfig.trackers must be a tuple of tracker names, e.g. "
                       f"('tensorboard', 'wandb'), got {self.trackers!r}")
    trackers_lib.check_names(self.trackers)
    object.__setattr__(self, "trackers", tuple(self.trackers))
