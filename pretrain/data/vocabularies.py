"""Vocabularies: bytes by default (no file needed), SentencePiece or a Hugging Face
`tokenizer.json` (`hf_vocabulary`) by path.

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
import numpy as np

from plumbing import storage
from pretrain.data.errors import DataError
from pretrain.data import hf_vocabulary

# SeqIO and TensorFlow load on first use (about 6 s): commands that only parse
# configs, print help or plan memory never touch them.
with epy.lazy_imports():
  import seqio


# ByteVocabulary's ids: 0 padding, 1 EOS, 2 UNK, then byte value b at b + 3.
_BYTE_OFFSET = 3
_SENTENCEPIECE_SPACE = "\u2581"  # '▁', SentencePiece's visible space


@gin.configurable
def get_vocabulary(spm_path: Optional[str] = None, tokenizer_json: Optional[str] = None,
                   eos_token: Optional[str] = None) -> seqio.Vocabulary:
  """Returns the byte vocabulary, the SentencePiece model at `spm_path`, or the Hugging
  Face tokenizer at `tokenizer_json`.

  Byte ids are 3 + byte value; 0 is padding, 1 is EOS, 2 is UNK (259 ids in all).

  Args:
    spm_path: a SentencePiece `.model` file, a path or gs:// / s3:// URL (e.g. written by
      `python -m pretrain.tokenizer`); None selects the byte vocabulary.
    tokenizer_json: a `tokenizer.json`, or a directory holding one (a saved model, a
      hub cache snapshot), local or gs:// / s3://; see `hf_vocabulary` for how its
      special tokens map onto EOS and padding.
    eos_token: the tokenizer's token that ends a document, when it is not one of the
      usual names (`hf_vocabulary.EOS_NAMES`).
  """
  if tokenizer_json:
    if spm_path:
      raise DataError("set get_vocabulary.spm_path or get_vocabulary.tokenizer_json, "
                      "not both")
    return hf_vocabulary.HfTokenizerVocabulary(_read_tokenizer_json(tokenizer_json),
                                               eos_token, source=tokenizer_json)
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


def _read_tokenizer_json(location: str) -> bytes:
  """The bytes of `location`, or of `location/tokenizer.json` for a directory."""
  path = location if storage.is_url(location) else os.path.expanduser(location)
  for candidate in (path, storage.join(path, hf_vocabulary.TOKENIZER_FILE)):
    if storage.exists(candidate) and not storage.isdir(candidate):
      return storage.read_bytes(candidate)
  raise DataError(
      f"tokenizer '{location}' is neither a tokenizer.json file nor a directory holding "
      "one; set get_vocabulary.tokenizer_json to the tokenizer.json a model ships with")


def vocabulary_fingerprint(vocabulary: seqio.Vocabulary) -> str:
  """A short string that changes whenever the token ids of some text would."""
  if isinstance(vocabulary, hf_vocabulary.HfTokenizerVocabulary):
    return f"hf:{vocabulary.digest[:16]}:eos={vocabulary.eos_token}"
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


def token_byte_lengths(vocabulary: seqio.Vocabulary, size: int) -> Optional[np.ndarray]:
  """UTF-8 bytes of text each token id stands for: int32 [size], the model's vocab size.

  Bits per byte divide the summed loss by the bytes of the text scored, which makes
  runs with different vocabularies comparable; the eval step sums this table over the
  weighted targets. Special ids (padding, EOS, UNK, SentencePiece control pieces, extra
  ids) and ids past the vocabulary count 0 bytes. Returns None for vocabularies whose
  ids stand for no text (the pass-through vocabulary of the synthetic tasks) or whose
  tokens' bytes the file does not say (a WordPiece tokenizer.json; see
  `hf_vocabulary.token_byte_lengths`, which counts the tokenizer.json ones).

  SentencePiece: a piece counts the UTF-8 bytes of its text with '▁' read as a space,
  a byte-fallback piece `<0xNN>` one byte. This is the length of the *normalised* text
  the model saw, an approximation of the raw text's: the dummy-prefix space SentencePiece
  adds before each document counts one byte that the raw text lacks, and a model whose
  normaliser rewrites text (NFKC, collapsed whitespace; `pretrain.tokenizer` trains with
  identity normalisation) counts the rewritten bytes.
  """
  if isinstance(vocabulary, seqio.ByteVocabulary):
    lengths = np.zeros(size, np.int32)
    lengths[_BYTE_OFFSET:_BYTE_OFFSET + 256] = 1
    return lengths
  if isinstance(vocabulary, seqio.SentencePieceVocabulary):
    return _sentencepiece_byte_lengths(vocabulary.tokenizer, size)
  if isinstance(vocabulary, hf_vocabulary.HfTokenizerVocabulary):
    return hf_vocabulary.token_byte_lengths(vocabulary.tokenizer, size)
  return None


def _sentencepiece_byte_lengths(processor, size: int) -> np.ndarray:
  """`token_byte_lengths` of a SentencePieceProcessor's pieces (extra ids: 0)."""
  lengths = np.zeros(size, np.int32)
  for i in range(min(processor.get_piece_size(), size)):
    if processor.is_control(i) or processor.is_unknown(i):
      continue
    if processor.is_byte(i):
      lengths[i] = 1
    else:
      lengths[i] = len(processor.id_to_piece(i).replace(_SENTENCEPIECE_SPACE, " ").encode())
  return lengths
