"""`pretrain.load(workdir, step=None)`: a trained (or converted) model, ready to call.

Everything comes from the checkpoint: parameters, and the JSON metadata that holds the
ModelConfig, the vocabulary and the training sequence length, so no Gin file is needed.

  model = pretrain.load("workdirs/quickstart")
  logits = model.logits(tokens, positions)        # float32 [B, T, V]
"""
from __future__ import annotations

import dataclasses
import os
import sys
import types
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from pretrain.cli import UserError


def model_config_to_dict(config: ModelConfig) -> dict[str, Any]:
  values = dataclasses.asdict(config)
  values["block_pattern"] = list(config.block_pattern)
  return values


def model_config_from_dict(values: dict[str, Any]) -> ModelConfig:
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(values) - known)
  if unknown:
    raise UserError(f"The checkpoint's model config has fields this version does not "
                    f"know: {unknown}")
  return ModelConfig(**values)


def vocabulary_spec(vocabulary: Any) -> str:
  """How the checkpoint metadata records a vocabulary, for `make_vocabulary`.

  'byte'; 'passthrough:<size>' for the identity vocabulary of synthetic tasks (their
  token ids are the model's ids, so the size is all there is to it); otherwise the
  absolute path of a SentencePiece model.
  """
  import seqio  # pylint: disable=g-import-not-at-top
  if isinstance(vocabulary, seqio.SentencePieceVocabulary):
    return os.path.abspath(vocabulary.sentencepiece_model_file)
  if isinstance(vocabulary, seqio.ByteVocabulary):
    return "byte"
  if isinstance(vocabulary, seqio.PassThroughVocabulary):
    return f"{_PASSTHROUGH_PREFIX}{vocabulary.vocab_size}"
  raise UserError(f"Cannot record vocabulary {type(vocabulary).__name__}: only byte, "
                  "pass-through and SentencePiece vocabularies are supported")


_PASSTHROUGH_PREFIX = "passthrough:"


def make_vocabulary(spec: str) -> Any:
  """The vocabulary a `vocabulary_spec` string describes."""
  if spec.startswith(_PASSTHROUGH_PREFIX):
    import seqio  # pylint: disable=g-import-not-at-top
    size = spec[len(_PASSTHROUGH_PREFIX):]
    if not size.isdigit() or int(size) < 1:
      raise UserError(f"Bad pass-through vocabulary {spec!r} in the checkpoint metadata: "
                      "expected 'passthrough:<positive size>'")
    return seqio.PassThroughVocabulary(int(size))
  from pretrain.data.vocabularies import get_vocabulary  # pylint: disable=g-import-not-at-top
  return get_vocabulary(None if spec == "byte" else spec)


class LoadedModel:
  """A model restored from a workdir.

  Attributes:
    config: the ModelConfig.
    params: the parameter pytree (float32, sharded over all devices like in training).
    step: the checkpoint's step.
    vocabulary: the SeqIO vocabulary the model was trained with.
    sequence_length: the training sequence length.
    setup: the trainer's Setup (mesh, shardings) for code that needs it.
  """

  def __init__(self, setup: Any, params: Any, step: int, metadata: dict[str, Any]):
    self.setup = setup
    self.config: ModelConfig = setup.config
    self.params = params
    self.step = step
    self.sequence_length = int(metadata.get("sequence_length") or 512)
    self._vocabulary_spec = metadata.get("vocabulary", "byte")
    self._vocabulary = None
    self._apply = jax.jit(lambda p, t, pos: setup.model.apply({"params": p}, t, pos)[0])

  @property
  def vocabulary(self) -> Any:
    if self._vocabulary is None:
      self._vocabulary = make_vocabulary(self._vocabulary_spec)
    return self._vocabulary

  @property
  def vocabulary_spec(self) -> str:
    return self._vocabulary_spec

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


def load(workdir: str, step: Optional[int] = None) -> LoadedModel:
  """Restores the newest complete checkpoint in `workdir` (or `step`)."""
  from pretrain.checkpointing import Checkpointer, complete_steps  # pylint: disable=g-import-not-at-top
  from pretrain.trainer import Setup  # pylint: disable=g-import-not-at-top
  checkpointer = Checkpointer(workdir, read_only=True)
  try:
    steps = complete_steps(checkpointer.directory)
    if not steps:
      raise UserError(f"No complete checkpoint in {checkpointer.directory}")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise UserError(f"No complete checkpoint of step {step} in {checkpointer.directory}; "
                      f"available: {steps}")
    metadata = checkpointer.metadata(step)
    setup = Setup(model_config_from_dict(metadata["model_config"]))
    restored = checkpointer.restore(step, abstract_params=setup.abstract_params)
  finally:
    checkpointer.close()
  return LoadedModel(setup, restored["params"], step, metadata)


def text_to_ids(vocabulary: Any, text: str) -> np.ndarray:
  return np.asarray(vocabulary.encode(text), np.int32)


class _CallableModule(types.ModuleType):
  """Lets `pretrain.load(workdir)` call `load` although `pretrain.load` is this module
  (Python binds a package's attribute to its submodule once the submodule is imported)."""

  def __call__(self, workdir: str, step: Optional[int] = None) -> LoadedModel:
    return load(workdir, step)


sys.modules[__name__].__class__ = _CallableModule
