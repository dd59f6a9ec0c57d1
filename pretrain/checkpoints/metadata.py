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
from pretrain.data import hf_vocabulary
from pretrain.data.vocabularies import get_vocabulary

# SeqIO and TensorFlow load on first use (about 6 s): commands that only parse
# configs, print help or plan memory never touch them.
with epy.lazy_imports():
  import seqio

_PASSTHROUGH_PREFIX = "passthrough:"
_SENTENCEPIECE_PREFIX = "sentencepiece:"
_TOKENIZER_JSON_PREFIX = "tokenizer.json:"
VOCABULARY_DIR = "vocabulary"
DEFAULT_SEQUENCE_LENGTH = 512


def _sentencepiece_file(workdir: str, digest: str) -> str:
  return storage.join(workdir, VOCABULARY_DIR, f"{digest}.model")


def _tokenizer_json_file(workdir: str, digest: str) -> str:
  return storage.join(workdir, VOCABULARY_DIR, f"{digest}.tokenizer.json")


def _store_once(path: str, data: bytes) -> None:
  if jax.process_index() == 0 and not storage.exists(path):
    storage.write_bytes(path, data)


def _read_checked(path: str, digest: str, workdir: Optional[str], what: str) -> bytes:
  """The bytes of a vocabulary file the workdir keeps by hash, checked against it."""
  if workdir is None or not storage.exists(path):
    raise UserError(f"The checkpoint's {what} {path} is missing: copy the "
                    f"whole workdir, including its {VOCABULARY_DIR}/ folder")
  data = storage.read_bytes(path)
  if hashlib.sha256(data).hexdigest() != digest:
    raise UserError(f"{path} does not match the checkpoint's vocabulary hash {digest}: "
                    "the file was changed; restore it from the original workdir")
  return data


def vocabulary_spec(vocabulary: seqio.Vocabulary, workdir: Optional[str] = None) -> str:
  """How the metadata records a vocabulary, for `make_vocabulary`.

  'byte'; 'passthrough:<size>' for the identity vocabulary of synthetic tasks (their
  token ids are the model's ids, so the size is all there is to it); for a SentencePiece
  model 'sentencepiece:<sha256 of the model>', after copying the model into
  `workdir/vocabulary/` (process 0; skipped when that file already exists); a
  `tokenizer.json` likewise, as 'tokenizer.json:<sha256>:<EOS token>'.
  """
  file_vocabularies = (seqio.SentencePieceVocabulary, hf_vocabulary.HfTokenizerVocabulary)
  if isinstance(vocabulary, file_vocabularies):
    if workdir is None:
      raise ValueError("a file vocabulary is stored in the workdir: pass workdir")
  if isinstance(vocabulary, hf_vocabulary.HfTokenizerVocabulary):
    _store_once(_tokenizer_json_file(workdir, vocabulary.digest), vocabulary.tokenizer_json)
    return f"{_TOKENIZER_JSON_PREFIX}{vocabulary.digest}:{vocabulary.eos_token}"
  if isinstance(vocabulary, seqio.SentencePieceVocabulary):
    model = vocabulary.sp_model
    digest = hashlib.sha256(model).hexdigest()
    _store_once(_sentencepiece_file(workdir, digest), model)
    return _SENTENCEPIECE_PREFIX + digest
  if isinstance(vocabulary, seqio.ByteVocabulary):
    return "byte"
  if isinstance(vocabulary, seqio.PassThroughVocabulary):
    return f"{_PASSTHROUGH_PREFIX}{vocabulary.vocab_size}"
  raise UserError(f"Cannot record vocabulary {type(vocabulary).__name__}: only byte, "
                  "pass-through, SentencePiece and tokenizer.json vocabularies are "
                  "supported")


def make_vocabulary(spec: str, workdir: Optional[str] = None) -> seqio.Vocabulary:
  """The vocabulary a `vocabulary_spec` string describes (a SentencePiece model is read
  from `workdir/vocabulary/`; an old checkpoint's absolute model path is read as is)."""
  if spec.startswith(_SENTENCEPIECE_PREFIX):
    digest = spec[len(_SENTENCEPIECE_PREFIX):]
    path = _sentencepiece_file(workdir or ".", digest)
    _read_checked(path, digest, workdir, "SentencePiece model")
    return seqio.SentencePieceVocabulary(storage.local_copy(path))
  if spec.startswith(_TOKENIZER_JSON_PREFIX):
    digest, _, eos_token = spec[len(_TOKENIZER_JSON_PREFIX):].partition(":")
    path = _tokenizer_json_file(workdir or ".", digest)
    return hf_vocabulary.HfTokenizerVocabulary(
        _read_checked(path, digest, workdir, "tokenizer.json"), eos_token or None,
        source=path)
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
