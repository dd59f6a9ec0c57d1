"""What a checkpoint records besides arrays, so it can be used without a Gin file.

`RunMetadata` is stored as the JSON item `metadata` of every checkpoint step (see
docs/INTERNALS.md, "Checkpoint layout"): the model's configuration, the vocabulary and
the training sequence length. `pretrain.load`, `evaluate`, `sample` and `convert` need
nothing else.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import seqio

from model.config import ModelConfig, model_config_from_dict, model_config_to_dict
from pretrain.data.vocabularies import get_vocabulary
from pretrain.errors import UserError

_PASSTHROUGH_PREFIX = "passthrough:"
DEFAULT_SEQUENCE_LENGTH = 512


def vocabulary_spec(vocabulary: seqio.Vocabulary) -> str:
  """How the metadata records a vocabulary, for `make_vocabulary`.

  'byte'; 'passthrough:<size>' for the identity vocabulary of synthetic tasks (their
  token ids are the model's ids, so the size is all there is to it); otherwise the
  absolute path of a SentencePiece model.
  """
  if isinstance(vocabulary, seqio.SentencePieceVocabulary):
    return os.path.abspath(vocabulary.sentencepiece_model_file)
  if isinstance(vocabulary, seqio.ByteVocabulary):
    return "byte"
  if isinstance(vocabulary, seqio.PassThroughVocabulary):
    return f"{_PASSTHROUGH_PREFIX}{vocabulary.vocab_size}"
  raise UserError(f"Cannot record vocabulary {type(vocabulary).__name__}: only byte, "
                  "pass-through and SentencePiece vocabularies are supported")


def make_vocabulary(spec: str) -> seqio.Vocabulary:
  """The vocabulary a `vocabulary_spec` string describes."""
  if spec.startswith(_PASSTHROUGH_PREFIX):
    size = spec[len(_PASSTHROUGH_PREFIX):]
    if not size.isdigit() or int(size) < 1:
      raise UserError(f"Bad pass-through vocabulary {spec!r} in the checkpoint metadata: "
                      "expected 'passthrough:<positive size>'")
    return seqio.PassThroughVocabulary(int(size))
  return get_vocabulary(None if spec == "byte" else spec)


@dataclasses.dataclass(frozen=True)
class RunMetadata:
  """The JSON metadata of a checkpoint.

  Attributes:
    model_config: the trained model's configuration.
    vocabulary: a `vocabulary_spec` string.
    sequence_length: the training sequence length.
  """
  model_config: ModelConfig
  vocabulary: str = "byte"
  sequence_length: int = DEFAULT_SEQUENCE_LENGTH

  def to_json(self) -> dict[str, Any]:
    return {"model_config": model_config_to_dict(self.model_config),
            "vocabulary": self.vocabulary, "sequence_length": self.sequence_length}

  @classmethod
  def from_json(cls, values: Mapping[str, Any]) -> "RunMetadata":
    try:
      config = model_config_from_dict(dict(values["model_config"]))
    except (KeyError, TypeError, ValueError) as error:
      raise UserError(f"The checkpoint's model config cannot be read by this version: "
                      f"{error}") from None
    return cls(config, values.get("vocabulary", "byte"),
               int(values.get("sequence_length") or DEFAULT_SEQUENCE_LENGTH))
