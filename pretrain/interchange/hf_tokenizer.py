"""The run's vocabulary as a Hugging Face fast tokenizer (`tokenizer.json`), id for id.

Both kinds start every encoded text with id 0, the document-start input our models are
trained with (the data pipeline shifts targets right behind a 0), and add no EOS. That
is what lm-evaluation-harness's `hf` backend and `generate` need: with ByT5's tokenizer
(the same byte ids, but it appends EOS whenever special tokens are on) lm_eval would
score every context with a stray EOS and cut the continuation's first byte.

* Byte vocabulary (seqio.ByteVocabulary: pad 0, EOS 1, UNK 2, byte b -> b + 3): a
  byte-level BPE without merges over the 256 bytes, so every byte is its own token.
* SentencePiece (`pretrain.tokenizer`'s BPE models: identity normalisation, no
  whitespace folding, byte fallback): the model's pieces and merges (ranked by piece
  score, as SentencePiece applies them), with SentencePiece's "▁" word-start marker and
  byte-fallback decoding. A model trained with other normalisation rules is refused,
  since the fast tokenizer would not reproduce them.
* A Hugging Face `tokenizer.json` (`pretrain.data.hf_vocabulary`): the file itself, its
  post-processor (which training never ran: it encodes without special tokens) replaced
  by the document start, and its EOS the one training appended. Its id 0 is the BOS
  and padding token when it is a special token, as in `pretrain.tokenizer`'s byte-level
  BPEs (`<pad>`), GPT-NeoX's or Mistral's. When id 0 is text (GPT-2's, Llama 3's and
  Qwen's `!`), the tokenizer still starts every text with it, as training did, but
  names no BOS: transformers would make a named one special, so it would cut it out of
  every text before encoding and drop it from every decoding. Decodings then begin with
  that text, and lm_eval's `hf` backend (which starts an empty context with the BOS, or
  else EOS) needs `prefix_token_id=0` in its model_args for empty contexts.
"""
from __future__ import annotations

import os
from typing import Any

from etils import epy

from plumbing.errors import UserError
from pretrain.data import hf_vocabulary

# SeqIO and TensorFlow load on first use (about 6 s).
with epy.lazy_imports():
  import seqio

DOCUMENT_START = "<pad>"   # id 0: what every document's first input is
SPECIAL = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
           "bos_token": DOCUMENT_START}


def _byte_tokenizer() -> Any:
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  alphabet = _bytes_to_unicode()
  vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
  vocab.update({alphabet[b]: b + 3 for b in range(256)})
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
  """The printable character the ByteLevel pre-tokenizer stands for each byte (GPT-2's
  table: printable Latin-1 bytes are themselves, the rest 256, 257, ... in byte order)."""
  printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(
      range(ord("®"), ord("ÿ") + 1))
  table, extra = {}, 0
  for b in range(256):
    if b in printable:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def _sentencepiece_tokenizer(model_proto: bytes) -> Any:
  from sentencepiece import sentencepiece_model_pb2  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer, decoders, models, normalizers  # pylint: disable=import-outside-toplevel
  from transformers.tokenization_utils_base import generate_merges  # pylint: disable=import-outside-toplevel
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(model_proto)
  spec, normalizer = proto.trainer_spec, proto.normalizer_spec
  if spec.model_type != spec.BPE or not spec.byte_fallback or (
      normalizer.name != "identity" or normalizer.remove_extra_whitespaces):
    raise UserError("Only SentencePiece BPE models with byte fallback, identity "
                    "normalisation and no whitespace folding (as pretrain.tokenizer trains "
                    "them) export to a Hugging Face tokenizer")
  vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
  scores = {piece.piece: piece.score for piece in proto.pieces
            if piece.type == piece.NORMAL}
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=generate_merges(vocab, scores),
                                   unk_token=proto.pieces[spec.unk_id].piece, fuse_unk=True,
                                   byte_fallback=True))
  steps = [normalizers.Replace(" ", "▁")]
  if normalizer.add_dummy_prefix:
    steps.insert(0, normalizers.Prepend("▁"))
  tokenizer.normalizer = normalizers.Sequence(steps)
  decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
  if normalizer.add_dummy_prefix:
    decode.append(decoders.Strip(content=" ", left=1))
  tokenizer.decoder = decoders.Sequence(decode)
  return tokenizer


def _tokenizer_json(vocabulary: Any) -> tuple[Any, dict[str, str]]:
  """(the tokenizer of a `tokenizer.json` vocabulary, its special tokens as transformers
  names them): EOS always, BOS and padding when id 0 is a special token."""
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  tokenizer = Tokenizer.from_str(vocabulary.tokenizer_json.decode())
  special = {"eos_token": vocabulary.eos_token}
  start = tokenizer.id_to_token(0)
  added = tokenizer.get_added_tokens_decoder().get(0)
  if added is not None and added.special:
    special.update(bos_token=start, pad_token=start)
  return tokenizer, special


def build(vocabulary: Any, model_max_length: int) -> Any:
  """A `PreTrainedTokenizerFast` for a seqio byte or SentencePiece vocabulary or a
  `tokenizer.json`, or None for vocabularies without text (the pass-through ids of
  synthetic tasks)."""
  from tokenizers import processors  # pylint: disable=import-outside-toplevel
  from transformers import PreTrainedTokenizerFast  # pylint: disable=import-outside-toplevel
  special = SPECIAL
  if isinstance(vocabulary, hf_vocabulary.HfTokenizerVocabulary):
    tokenizer, special = _tokenizer_json(vocabulary)
  elif isinstance(vocabulary, seqio.SentencePieceVocabulary):
    tokenizer = _sentencepiece_tokenizer(vocabulary.sp_model)
  elif isinstance(vocabulary, seqio.ByteVocabulary):
    tokenizer = _byte_tokenizer()
  else:
    return None
  start = tokenizer.id_to_token(0)
  tokenizer.post_processor = processors.TemplateProcessing(
      single=f"{start} $A", pair=f"{start} $A $B", special_tokens=[(start, 0)])
  return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=model_max_length,
                                 **special)


def save(vocabulary: Any, directory: str, model_max_length: int) -> bool:
  """Writes the tokenizer files into `directory`; False when the vocabulary has no text.

  A SentencePiece vocabulary also leaves its model as `tokenizer.model`, which
  `pretrain.convert hf` reads back (and which SentencePiece users expect there).
  """
  tokenizer = build(vocabulary, model_max_length)
  if tokenizer is None:
    return False
  tokenizer.save_pretrained(directory)
  if isinstance(vocabulary, seqio.SentencePieceVocabulary):
    with open(os.path.join(directory, "tokenizer.model"), "wb") as f:
      f.write(vocabulary.sp_model)
  return True
