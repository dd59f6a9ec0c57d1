"""`pretrain.load(workdir, step=None)`: a trained (or converted) model, ready to call.

Everything comes from the checkpoint: parameters, and the JSON metadata that holds the
ModelConfig, the vocabulary and the training sequence length, so no Gin file is needed.

  model = pretrain.load("workdirs/quickstart")
  logits = model.logits(tokens, positions)        # float32 [B, T, V]
"""
from __future__ import annotations

from typing import Any, Optional

from etils import epy
import jax
import jax.numpy as jnp

from model.config import ModelConfig
from plumbing.errors import UnreadableCheckpointError, UserError, warn
from pretrain.checkpoints.persistent import PersistentTier
from pretrain.checkpoints.metadata import RunMetadata, make_vocabulary
from pretrain.run_directory import RunDirectory
from pretrain.runtime import Runtime
from sharding.mesh import MeshConfig

# SeqIO and TensorFlow load on first use (about 6 s): commands that only parse
# configs, print help or plan memory never touch them.
with epy.lazy_imports():
  import seqio


class LoadedModel:
  """A model restored from a workdir.

  Attributes:
    config: the ModelConfig.
    params: the parameter pytree (float32, sharded over all devices like in training).
    step: the checkpoint's step.
    metadata: the checkpoint's RunMetadata.
    sequence_length: the training sequence length.
    runtime: the Runtime (mesh, shardings) for code that needs it.
    workdir: the run directory it came from (its `vocabulary/` holds a SentencePiece
      model).
  """

  def __init__(self, runtime: Runtime, params: Any, step: int, metadata: RunMetadata,
               workdir: Optional[str] = None):
    self.runtime = runtime
    self.workdir = workdir
    self.config: ModelConfig = runtime.config
    self.params = params
    self.step = step
    self.metadata = metadata
    self.sequence_length = metadata.sequence_length
    self._vocabulary: Optional[seqio.Vocabulary] = None
    self._apply = jax.jit(lambda p, t, pos: runtime.model.apply({"params": p}, t, pos)[0])

  @property
  def vocabulary(self) -> seqio.Vocabulary:
    if self._vocabulary is None:
      self._vocabulary = make_vocabulary(self.metadata.vocabulary, self.workdir)
    return self._vocabulary

  @property
  def vocabulary_spec(self) -> str:
    return self.metadata.vocabulary

  def apply(self, params: Any, tokens: Any, positions: Any) -> jax.Array:
    """float32 logits [B, T, V] of `params` for int32 tokens/positions [B, T]."""
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    if tokens.ndim != 2 or tokens.shape != positions.shape:
      raise ValueError(f"tokens and positions must both be [B, T]; got {tokens.shape} and "
                       f"{positions.shape}")
    return self._apply(params, tokens, positions).astype(jnp.float32)

  def logits(self, tokens: Any, positions: Any) -> jax.Array:
    """float32 logits [B, T, V] of the loaded parameters."""
    return self.apply(self.params, tokens, positions)


def load(workdir: str, step: Optional[int] = None,
         mesh_config: MeshConfig = MeshConfig()) -> LoadedModel:
  """Restores the newest readable checkpoint in `workdir` (or `step`) over all devices.

  A checkpoint that fails its integrity check or cannot be read is skipped, with one
  line on stderr, for the next older one; an unreadable `step` is an
  UnreadableCheckpointError. Reading never renames or deletes anything (the trainer
  sets unreadable checkpoints aside).
  """
  checkpointer = PersistentTier(RunDirectory(workdir), read_only=True)
  skipped = []
  try:
    steps = checkpointer.all_steps()
    if not steps:
      raise UserError(f"No complete checkpoint in {checkpointer.directory}")
    if step is not None and step not in steps:
      raise UserError(f"No complete checkpoint of step {step} in {checkpointer.directory}; "
                      f"available: {steps}")
    for candidate in reversed(steps) if step is None else [step]:
      try:
        model = _restore(checkpointer, candidate, mesh_config)
        break
      except UnreadableCheckpointError as error:
        if step is not None:
          raise
        skipped.append(error)
    else:
      raise UserError(f"No readable checkpoint in {checkpointer.directory}: " +
                      "; ".join(str(error) for error in skipped))
  finally:
    checkpointer.close()
  for error in skipped:
    warn(f"{error}: using {model.step}")
  return model


def _restore(checkpointer: PersistentTier, step: int, mesh_config: MeshConfig
             ) -> LoadedModel:
  metadata = RunMetadata.from_json(checkpointer.metadata(step))
  runtime = Runtime.create(metadata.model_config, mesh_config)
  restored = checkpointer.restore(step, abstract_params=runtime.abstract_params)
  return LoadedModel(runtime, restored.params, step, metadata, checkpointer.run.root)
