"""Vocabularies: bytes by default (no file needed), SentencePiece by path.

A vocabulary is part of a SeqIO task's definition, and part of the token store's cache
key, so `vocabulary_fingerprint` identifies it by content (a retrained SentencePiece
model at the same path gets a new store).
"""
from __future__ import annotations

import hashlib
import os
from typing import Optional

from etils import epy
import gin

from pretrain import storage
from pretrain.data.errors import DataError

# SeqIO and TensorFlow load on first use (about 6 s): commands that only parse
# configs, print help or plan memory never touch them.
with epy.lazy_imports():
  import seqio


@gin.configurable
def get_vocabulary(spm_path: Optional[str] = None) -> seqio.Vocabulary:
  """Returns the byte vocabulary, or the SentencePiece model at `spm_path`.

  Byte ids are 3 + byte value; 0 is padding, 1 is EOS, 2 is UNK (259 ids in all).

  Args:
    spm_path: a SentencePiece `.model` file, a path or gs:// / s3:// URL (e.g. written by
      `python -m pretrain.tokenizer`); None selects the byte vocabulary.
  """
  if spm_path is None or spm_path in ("", "byte", "bytes"):
    return seqio.ByteVocabulary()
  if storage.is_url(spm_path) and storage.exists(spm_path):
    spm_path = storage.local_copy(spm_path)  # SentencePiece reads local files only
  path = os.path.expanduser(spm_path)
  if not os.path.isfile(path):
    raise DataError(
        f"SentencePiece model '{spm_path}' does not exist; train one with "
        "`python -m pretrain.tokenizer --input_glob=... --vocab_size=N "
        "--output=PATH` or set get_vocabulary.spm_path=None for bytes")
  return seqio.SentencePieceVocabulary(path)


def vocabulary_fingerprint(vocabulary: seqio.Vocabulary) -> str:
  """A short string that changes whenever the token ids of some text would."""
  if isinstance(vocabulary, seqio.ByteVocabulary):
    return f"byte:extra{vocabulary.extra_ids}"
  if isinstance(vocabulary, seqio.SentencePieceVocabulary):
    digest = hashlib.sha256(vocabulary.sp_model).hexdigest()[:16]
    return f"spm:{digest}:extra{vocabulary.extra_ids}"
  return f"{type(vocabulary).__qualname__}:{vocabulary.vocab_size}"


def short_vocabulary_name(vocabulary: seqio.Vocabulary) -> str:
  """A name fragment for task names that differ only in their vocabulary."""
  fingerprint = vocabulary_fingerprint(vocabulary)
  if fingerprint == "byte:extra0":
    return "bytes"
  return "v" + hashlib.sha256(fingerprint.encode()).hexdigest()[:10]
