"""A `Trainer` built in the test process, on a toy input pipeline: for tests of the
trainer's seams (hooks, checkpoint tiers, block types) that need no data files and no
subprocess."""
from typing import Optional

import numpy as np

from model.config import ModelConfig
from pretrain.checkpoints.checkpointer import CheckpointConfig, Checkpointer
from pretrain.data.vocabularies import get_vocabulary
from pretrain.observability.goodput import GoodputClock
from pretrain.observability.metrics import MetricsWriter
from pretrain.optimizer import OptimizerConfig
from pretrain.run_directory import RunDirectory
from pretrain.runtime import Runtime
from pretrain.trainer import TrainConfig, Trainer, train
from sharding.mesh import MeshConfig

PERIOD = 16   # the toy data repeats every PERIOD tokens: learnable in a few steps


class ToyPipeline:
  """A `pretrain.trainer.Pipeline` of counting sequences (byte ids 3..3+PERIOD), one
  document per row, the offset a function of (step, row)."""

  def __init__(self, batch_size: int, sequence_length: int):
    self.vocabulary = get_vocabulary()
    self.vocab_size = self.vocabulary.vocab_size
    self._rows, self._length = batch_size, sequence_length

  def batch(self, step: int) -> dict[str, np.ndarray]:
    offsets = (step * self._rows + np.arange(self._rows))[:, None]
    targets = ((offsets + np.arange(self._length)) % PERIOD + 3).astype(np.int32)
    inputs = np.concatenate([np.zeros((self._rows, 1), np.int32), targets[:, :-1]], 1)
    positions = np.broadcast_to(np.arange(self._length, dtype=np.int32), targets.shape)
    return {"inputs": inputs, "targets": targets, "positions": positions.copy(),
            "segment_ids": np.ones_like(targets), "weights": np.ones(targets.shape,
                                                                     np.float32)}

  def validation_batches(self, max_batches: Optional[int] = None):
    return [self.batch(10_000 + b) for b in range(max_batches or 1)]

  def describe(self) -> str:
    return "data: toy counting sequences"


# The model of the in-process runs: every test that trains it shares its compiled step
# through the JAX cache.
TINY_MODEL = ModelConfig(vocab_size=260, width=32, rnn_width=32, num_heads=2, depth=2,
                         block_pattern=("recurrent", "attention"), attention_window=8,
                         scan_impl="lax")


def make_trainer(workdir: str, model: ModelConfig, *, train_steps: int,
                 checkpoint_every: int, mesh: MeshConfig = MeshConfig(data=2, fsdp=2,
                                                                        tensor=2),
                 batch_size: int = 4, sequence_length: int = 32
                 ) -> tuple[Trainer, Checkpointer, MetricsWriter]:
  """A Trainer of `model` in `workdir` (synchronous saves, no evaluation), its
  checkpointer and its metrics writer; the caller closes the last two."""
  config = TrainConfig(train_steps=train_steps, batch_size=batch_size,
                       sequence_length=sequence_length, checkpoint_every=checkpoint_every,
                       eval_every=0, log_every=1, final_eval=False, seed=1)
  run = RunDirectory(workdir)
  checkpointer = Checkpointer.for_run(run, CheckpointConfig(async_save=False),
                                      every=checkpoint_every)
  writer = MetricsWriter(workdir, train_steps, trackers=())
  trainer = Trainer(run, config, Runtime.create(model, mesh),
                    OptimizerConfig(peak_learning_rate=1e-2, warmup_steps=2),
                    ToyPipeline(batch_size, sequence_length), checkpointer, writer,
                    GoodputClock())
  return trainer, checkpointer, writer


def train_in_process(workdir: str, model: ModelConfig, config: TrainConfig, *,
                     hooks=(), mesh: MeshConfig = MeshConfig(data=2, fsdp=2, tensor=2),
                     checkpoint_config: CheckpointConfig = CheckpointConfig(async_save=False)):
  """`pretrain.trainer.train` of `model` on the toy pipeline, as the CLI runs it
  (synchronous saves unless `checkpoint_config` says otherwise; the optimizer of
  `make_trainer`): the whole session, its writer and trackers included."""
  run = RunDirectory(workdir, checkpoint_config.local_dir)
  return train(run, config, Runtime.create(model, mesh),
               OptimizerConfig(peak_learning_rate=1e-2, warmup_steps=2),
               Checkpointer.for_run(run, checkpoint_config, every=config.checkpoint_every),
               lambda cfg, runtime: ToyPipeline(cfg.batch_size, cfg.sequence_length),
               hooks=hooks)
