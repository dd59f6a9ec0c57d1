"""A Hugging Face `tokenizer.json` as a SeqIO vocabulary (read with `tokenizers`).

Most tokenizers people pretrain with ship as a `tokenizer.json` (GPT-2/NeoX style
byte-level BPE, Llama 3, Mistral, Qwen, OLMo); this reads one as is, so token ids are
the tokenizer's own and a model trained here speaks its family's ids.

How its tokens map onto the pipeline's conventions:
- EOS, appended to every document, is the tokenizer's end-of-text token: `eos_token`
  when given, else the first special token named like one (`<|endoftext|>`, `</s>`,
  `<eos>`, `<|end_of_text|>`, `<|im_end|>`, `<|eot_id|>`). A tokenizer with none is
  refused in one line.
- Padding and the document-start input are id 0, as for every vocabulary here. Neither
  is ever scored (padding has segment 0 and weight 0; the start input is an input, not
  a target), so id 0 may be a text token (GPT-2's "!"). No BOS is added: text is
  encoded without the tokenizer's post-processor (`add_special_tokens=False`).
- Documents are encoded in batches (`encode_batch`, the library's Rust threads), see
  `encode_batch` and `pretrain.data.tasks`.
- Bits per byte need the bytes each token stands for (`token_byte_lengths`): known for
  byte-level BPEs and for tokenizers whose tokens are text with a space marker ('▁')
  and byte-fallback tokens; None for the rest (WordPiece, say).
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Callable, Iterable, List, Optional, Sequence

from etils import epy
import numpy as np

from pretrain.data.errors import DataError

with epy.lazy_imports():
  import seqio
  import tensorflow as tf
  import tokenizers

TOKENIZER_FILE = "tokenizer.json"
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>",
             "<|eot_id|>")
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")   # what ByteFallback decodes


def __getattr__(name: str):
  """`HfTokenizerVocabulary`, defined on first use: it subclasses SeqIO's `Vocabulary`,
  and SeqIO (with TensorFlow, about 6 s to import) loads only where data is read, not
  where a command merely imports the modules that name this class."""
  if name != "HfTokenizerVocabulary":
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  globals()[name] = vocabulary_class = _define_vocabulary_class()
  return vocabulary_class


def _define_vocabulary_class() -> type:
  """The class `__getattr__` defines once."""

  class HfTokenizerVocabulary(seqio.Vocabulary):
    """A `tokenizer.json`'s ids, EOS from its special tokens, padding id 0.

    Attributes:
      tokenizer_json: the file's bytes (what checkpoints copy and the cache key hashes).
      digest: sha256 of `tokenizer_json`.
      source: where it was read from (a checkpoint's copy, once reloaded from one).
    """

    def __init__(self, tokenizer_json: bytes, eos_token: Optional[str] = None,
                 source: str = TOKENIZER_FILE):
      super().__init__(extra_ids=0)
      self.tokenizer_json = bytes(tokenizer_json)
      self.digest = hashlib.sha256(self.tokenizer_json).hexdigest()
      self.source = source
      try:
        self.tokenizer = tokenizers.Tokenizer.from_str(self.tokenizer_json.decode())
      except Exception as error:  # pylint: disable=broad-except
        raise DataError(f"{source} is not a Hugging Face tokenizer.json "
                        f"({str(error).splitlines()[0]}); point get_vocabulary.path at the "
                        "tokenizer.json a model ships with") from None
      self.eos_token = eos_token or _find_eos(self.tokenizer, source)
      eos_id = self.tokenizer.token_to_id(self.eos_token)
      if eos_id is None:
        raise DataError(f"{source} has no token {self.eos_token!r} to use as EOS; set "
                        "get_vocabulary.eos_token to one of its special tokens")
      self._eos_id = int(eos_id)

    @property
    def eos_id(self) -> int:
      return self._eos_id

    @property
    def pad_id(self) -> int:
      return 0

    @property
    def unk_id(self) -> Optional[int]:
      return None

    @property
    def _base_vocab_size(self) -> int:
      return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
      """Token ids of many documents at once (the library's own threads)."""
      return [e.ids for e in self.tokenizer.encode_batch(list(texts),
                                                         add_special_tokens=False)]

    def _encode(self, s: str) -> List[int]:
      return self.encode_batch([s])[0]

    def _decode(self, ids: Iterable[int]) -> str:
      return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def _encode_tf(self, s):
      """Scalar or vector of strings -> int32 (ragged for a vector) ids."""
      s = tf.convert_to_tensor(s)
      strings = tf.reshape(s, [-1])

      def encode(values):
        ids = self.encode_batch([v.decode("utf-8", "replace") for v in values])
        lengths = np.array([len(i) for i in ids], np.int64)
        flat = np.fromiter((t for i in ids for t in i), np.int32, int(lengths.sum()))
        return flat, lengths

      flat, lengths = tf.numpy_function(encode, [strings], [tf.int32, tf.int64],
                                        stateful=False)
      flat.set_shape([None])
      ragged = tf.RaggedTensor.from_row_lengths(flat, lengths)
      return ragged[0] if s.shape.rank == 0 else ragged

    def _decode_tf(self, ids):
      def decode(values):
        return np.array(self._decode(values.tolist()).encode())
      return tf.numpy_function(decode, [tf.reshape(ids, [-1])], tf.string, stateful=False)

    def __eq__(self, other) -> bool:
      return (type(other) is type(self) and other.digest == self.digest
              and other.eos_token == self.eos_token)

    def __hash__(self) -> int:
      return hash((self.digest, self.eos_token))

  return HfTokenizerVocabulary


def _find_eos(tokenizer, source: str) -> str:
  special = {t.content for t in tokenizer.get_added_tokens_decoder().values()
             if t.special}
  for name in EOS_NAMES:
    if name in special:
      return name
  raise DataError(
      f"{source} has no end-of-text special token (none of {', '.join(EOS_NAMES)}); "
      "set get_vocabulary.eos_token to the token that ends a document")


def token_byte_lengths(tokenizer: tokenizers.Tokenizer, size: int) -> Optional[np.ndarray]:
  """Bytes of text each id of `tokenizer` stands for, int32 [size]; None when unknown.

  Special tokens (EOS, padding, BOS), the model's unknown token (special or not: the
  text it replaced is lost) and ids past the tokenizer count 0 bytes; a non-special
  added token its content's UTF-8 bytes (the literal text it matches). The
  others follow the decoder, the one place a tokenizer.json says what text a token is:
  - ByteLevel (GPT-2, NeoX, Llama 3, Qwen): a token of the 256-character byte alphabet
    stands for one raw byte per character, so over an encoded text the counts sum to
    its UTF-8 length (its normalised text's where a normaliser rewrites it: Qwen's NFC).
  - Metaspace / Replace, ByteFallback, Fuse, Strip (SentencePiece conversions: Llama 2,
    Mistral, T5): the token's UTF-8 bytes with the space marker read as a space, 1 for
    a byte-fallback token `<0xNN>`. As for a SentencePiece model this is the text the
    normaliser and pre-tokeniser left, so the dummy-prefix space counts one byte.
  - Anything else is None: no decoder (tokens are joined with spaces the text may not
    have had), WordPiece's '##' or a '</w>' word-end suffix (markers, not text, and the
    spaces between words are guessed), regex replacements or CTC, whose output depends
    on the neighbouring tokens.
  """
  config = json.loads(tokenizer.to_str())
  length = _length_rule(config)
  if length is None:
    return None
  lengths = np.zeros(size, np.int32)
  added = tokenizer.get_added_tokens_decoder()
  unknown = _unknown_id(tokenizer, config["model"])
  for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
    if i >= size or i == unknown or (i in added and added[i].special):
      continue
    lengths[i] = len(added[i].content.encode()) if i in added else length(token)
  return lengths


def _length_rule(config: dict) -> Optional[Callable[[str], int]]:
  """token -> bytes for a tokenizer.json's model and decoder (see `token_byte_lengths`)."""
  model, decoder = config["model"], config["decoder"]
  if decoder is None or model.get("continuing_subword_prefix") or model.get(
      "end_of_word_suffix"):
    return None
  steps = _decoder_steps(decoder)
  if [step["type"] for step in steps] == ["ByteLevel"]:
    return _byte_level_length
  return _text_length_rule(steps)


def _unknown_id(tokenizer: tokenizers.Tokenizer, model: dict) -> Optional[int]:
  """The id of the model's unknown token: named by BPE and WordPiece, numbered by
  Unigram; None when it has none (byte-level and byte-fallback models need none)."""
  if model.get("unk_token"):
    return tokenizer.token_to_id(model["unk_token"])
  return model.get("unk_id")


def _decoder_steps(decoder: dict) -> List[dict]:
  """A decoder as the list of decoders it applies in order (Sequences flattened)."""
  if decoder["type"] != "Sequence":
    return [decoder]
  return [step for inner in decoder["decoders"] for step in _decoder_steps(inner)]


def _byte_level_length(token: str) -> int:
  """A ByteLevel token's raw bytes: one per byte-alphabet character. A token outside
  the alphabet the decoder passes through as its UTF-8 text, so it counts those."""
  if set(token) <= _byte_alphabet():
    return len(token)
  return len(token.encode())


@functools.cache
def _byte_alphabet() -> frozenset:
  """The 256 characters a ByteLevel pre-tokeniser writes bytes as."""
  return frozenset(tokenizers.pre_tokenizers.ByteLevel.alphabet())


def _text_length_rule(steps: Sequence[dict]) -> Optional[Callable[[str], int]]:
  """token -> bytes for decoders that rewrite each token on its own (space markers,
  byte fallback) and then join them (Fuse), at most trimming the joined text's ends
  (Strip: the dummy-prefix space); None for any other decoder."""
  replacements, byte_fallback, fused = [], False, False
  for step in steps:
    kind = step["type"]
    if kind == "Metaspace" and not fused:
      replacements.append((step["replacement"], " "))
    elif kind == "Replace" and "String" in step["pattern"] and not fused:
      replacements.append((step["pattern"]["String"], step["content"]))
    elif kind == "ByteFallback" and not fused:
      byte_fallback = True
    elif kind == "Fuse":
      fused = True
    elif not (kind == "Strip" and fused):   # a Strip before Fuse trims every token
      return None

  def length(token: str) -> int:
    if byte_fallback and _BYTE_FALLBACK_TOKEN.fullmatch(token):
      return 1
    for old, new in replacements:
      token = token.replace(old, new)
    return len(token.encode())
  return length
