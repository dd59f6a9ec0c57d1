r"""Trains a vocabulary on a text corpus: the library of `python -m pretrain.tokenizer`.

Two kinds, each written so that the data pipeline reads it with no further settings:
* SentencePiece (`train_sentencepiece`, a `.model` for `get_vocabulary.spm_path`): ids
  0 = padding and document start, 1 = EOS, 2 = UNK, no BOS.
* Byte-level BPE (`train_byte_level_bpe`, GPT-2 style, a Hugging Face `tokenizer.json`
  for `get_vocabulary.tokenizer_json`): special tokens `<pad>` = 0 (padding and the
  document-start input) and `<|endoftext|>` = 1 (the EOS `hf_vocabulary` finds by
  name), then the 256 bytes, then the merges. Every text encodes (no UNK) and decodes
  back exactly.
"""
from __future__ import annotations

import io
import os
from typing import Iterator

from etils import epy
import sentencepiece as spm

from plumbing import storage
from plumbing.errors import usage_error
from pretrain.data import corpus_files
from pretrain.data.errors import DataError

# The corpus sources build tf.data pipelines: TensorFlow (about 6 s) loads only when a
# corpus in one of their formats is read.
with epy.lazy_imports():
  from pretrain.data import sources

BPE_SPECIAL_TOKENS = ("<pad>", "<|endoftext|>")
BPE_MIN_VOCAB_SIZE = len(BPE_SPECIAL_TOKENS) + 256


def corpus_texts(input_glob: str, text_field: str = "text") -> Iterator[str]:
  """The documents of a corpus, streamed.

  A corpus in a format `configs/data/corpus.gin` reads (`pretrain.data.sources`:
  Parquet, `.jsonl[.gz|.zst]`, a `datasets` `save_to_disk` directory; a glob, a
  directory or one file, local or gs:// / s3://) is read by that format's reader, every
  document of it (no held-out split). Anything else is a glob read like the text-files
  task's: `{stdlib}` placeholder, one document per file, or per line of a `.jsonl` file
  (its `text_field`).
  """
  fmt = corpus_files.corpus_format(input_glob)
  if fmt is not None:
    source = sources.source_for(fmt)(input_glob, text_field, flag="--input_glob")
    yield from source.split_texts(sources.TRAIN)
    return
  for path in corpus_files.match_files(input_glob, flag="input_glob"):
    if path.endswith(".jsonl"):
      yield from corpus_files.iter_jsonl_texts(path, text_field)
    else:
      with open(path, "rb") as f:
        yield f.read().decode("utf-8", errors="replace")


def corpus_lines(input_glob: str, text_field: str = "text") -> Iterator[str]:
  """Non-empty lines of every document (newlines stripped)."""
  for text in corpus_texts(input_glob, text_field):
    for line in text.splitlines():
      if line.strip():
        yield line


def _no_text(input_glob: str) -> DataError:
  return DataError(f"files matching '{input_glob}' hold no text; point --input_glob at text")


def train_sentencepiece(input_glob: str, vocab_size: int, output: str,
                        model_type: str = "bpe", max_lines: int = 2_000_000,
                        text_field: str = "text") -> str:
  """Trains a model on the files matching `input_glob`; returns the `.model` path."""
  if vocab_size < 8:
    raise DataError(f"--vocab_size={vocab_size} is too small; use e.g. 4096")
  lines = list(corpus_lines(input_glob, text_field))
  if not lines:
    raise _no_text(input_glob)
  if len(lines) > max_lines:  # an even sample keeps every part of the corpus
    lines = lines[::-(-len(lines) // max_lines)]
  output = output if output.endswith(".model") else output + ".model"
  output = storage.resolve(output)  # a path, or a gs:// / s3:// URL
  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model,
        vocab_size=vocab_size, model_type=model_type,
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True,
        byte_fallback=True, character_coverage=1.0,
        max_sentence_length=1 << 14, hard_vocab_limit=False,
        num_threads=os.cpu_count() or 1, minloglevel=2)
  except RuntimeError as e:
    raise DataError(f"SentencePiece training failed: {e}") from None
  storage.write_bytes(output, model.getvalue())  # whole: never a half-written model
  processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
  storage.write_text(output[:-len(".model")] + ".vocab", "".join(
      f"{processor.id_to_piece(i)}\t{processor.get_score(i)}\n"
      for i in range(processor.get_piece_size())))
  return output


def train_byte_level_bpe(input_glob: str, vocab_size: int, output: str,
                         text_field: str = "text") -> str:
  """Trains a byte-level BPE on the documents of `input_glob`; returns the path of the
  `tokenizer.json` written: `output` itself when it ends in `.json`, else
  `output/tokenizer.json` (the layout of a saved model, which get_vocabulary reads).

  Documents stream through the trainer whole (newlines and indentation runs become
  tokens, as in GPT-2's vocabulary), never all held in memory. A small corpus may
  leave fewer merges than `vocab_size` asks for.
  """
  # pylint: disable-next=import-outside-toplevel
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  if vocab_size < BPE_MIN_VOCAB_SIZE:
    raise usage_error(f"--vocab_size={vocab_size} is too small for a byte-level BPE: its "
                    f"{len(BPE_SPECIAL_TOKENS)} special tokens and 256 bytes need "
                    f"{BPE_MIN_VOCAB_SIZE}; use e.g. 32768")
  documents = [0]

  def counted(texts: Iterator[str]) -> Iterator[str]:
    for text in texts:
      if text.strip():
        documents[0] += 1
        yield text

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(counted(corpus_texts(input_glob, text_field)),
                                trainers.BpeTrainer(
                                    vocab_size=vocab_size,
                                    special_tokens=list(BPE_SPECIAL_TOKENS),
                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                    show_progress=False))
  if not documents[0]:
    raise _no_text(input_glob)
  output = storage.resolve(output)
  if not output.endswith(".json"):
    output = storage.join(output, "tokenizer.json")
  storage.write_text(output, tokenizer.to_str())  # whole: never a half-written file
  return output
