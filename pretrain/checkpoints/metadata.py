"""What a checkpoint records besides arrays, so it can be used without a Gin file.

`RunMetadata` is stored as the JSON item `metadata` of every checkpoint step (see
docs/INTERNALS.md, "Checkpoint layout"): the model's configuration, the vocabulary and
the training sequence length. `pretrain.load`, `evaluate`, `sample` and `convert` need
nothing else: a SentencePiece model is copied into the workdir
(`vocabulary/<sha256>.model`, content-addressed) and the metadata names it by hash, so
a workdir copied elsewhere or read from a bucket still has its vocabulary.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping, Optional

from etils import epy
import jax

from model.config import ModelConfig, model_config_from_dict, model_config_to_dict
from plumbing import storage
from plumbing.errors import UserError
from pretrain.data.vocabularies import get_vocabulary

# SeqIO and TensorFlow load on first use (about 6 s): commands that only parse
# configs, print help or plan memory never touch them.
with epy.lazy_imports():
  import seqio

_PASSTHROUGH_PREFIX = "passthrough:"
_SENTENCEPIECE_PREFIX = "sentencepiece:"
VOCABULARY_DIR = "vocabulary"
DEFAULT_SEQUENCE_LENGTH = 512


def _sentencepiece_file(workdir: str, digest: str) -> str:
  return storage.join(workdir, VOCABULARY_DIR, f"{digest}.model")


def vocabulary_spec(vocabulary: seqio.Vocabulary, workdir: Optional[str] = None) -> str:
  """How the metadata records a vocabulary, for `make_vocabulary`.

  'byte'; 'passthrough:<size>' for the identity vocabulary of synthetic tasks (their
  token ids are the model's ids, so the size is all there is to it); for a SentencePiece
  model 'sentencepiece:<sha256 of the model>', after copying the model into
  `workdir/vocabulary/` (process 0; skipped when that file already exists).
  """
  if isinstance(vocabulary, seqio.SentencePieceVocabulary):
    if workdir is None:
      raise ValueError("a SentencePiece vocabulary is stored in the workdir: pass workdir")
    model = vocabulary.sp_model
    digest = hashlib.sha256(model).hexdigest()
    path = _sentencepiece_file(workdir, digest)
    if jax.process_index() == 0 and not storage.exists(path):
      storage.write_bytes(path, model)
    return _SENTENCEPIECE_PREFIX + digest
  if isinstance(vocabulary, seqio.ByteVocabulary):
    return "byte"
  if isinstance(vocabulary, seqio.PassThroughVocabulary):
    return f"{_PASSTHROUGH_PREFIX}{vocabulary.vocab_size}"
  raise UserError(f"Cannot record vocabulary {type(vocabulary).__name__}: only byte, "
                  "pass-through and SentencePiece vocabularies are supported")


def make_vocabulary(spec: str, workdir: Optional[str] = None) -> seqio.Vocabulary:
  """The vocabulary a `vocabulary_spec` string describes (a SentencePiece model is read
  from `workdir/vocabulary/`; an old checkpoint's absolute model path is read as is)."""
  if spec.startswith(_SENTENCEPIECE_PREFIX):
    digest = spec[len(_SENTENCEPIECE_PREFIX):]
    path = _sentencepiece_file(workdir or ".", digest)
    if workdir is None or not storage.exists(path):
      raise UserError(f"The checkpoint's SentencePiece model {path} is missing: copy the "
                      f"whole workdir, including its {VOCABULARY_DIR}/ folder")
    local = storage.local_copy(path)
    with open(local, "rb") as f:
      if hashlib.sha256(f.read()).hexdigest() != digest:
        raise UserError(f"{path} does not match the checkpoint's vocabulary hash {digest}: "
                        "the file was changed; restore it from the original workdir")
    return seqio.SentencePieceVocabulary(local)
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
