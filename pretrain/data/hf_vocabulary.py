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
"""
from __future__ import annotations

import hashlib
from typing import Iterable, List, Optional, Sequence

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
