r"""Trains a SentencePiece vocabulary on a text corpus: the library of
`python -m pretrain.tokenizer`.
"""
from __future__ import annotations

import io
import os
from typing import Iterator

import sentencepiece as spm

from plumbing import storage
from pretrain.data import corpus_files
from pretrain.data.errors import DataError


def corpus_lines(input_glob: str) -> Iterator[str]:
  """Non-empty lines of every document matching the glob (newlines stripped)."""
  for path in corpus_files.match_files(input_glob, flag="input_glob"):
    if path.endswith(".jsonl"):
      texts = corpus_files.iter_jsonl_texts(path)
    else:
      with open(path, "rb") as f:
        texts = [f.read().decode("utf-8", errors="replace")]
    for text in texts:
      for line in text.splitlines():
        if line.strip():
          yield line


def train_sentencepiece(input_glob: str, vocab_size: int, output: str,
                        model_type: str = "bpe",
                        max_lines: int = 2_000_000) -> str:
  """Trains a model on the files matching `input_glob`; returns the `.model` path."""
  if vocab_size < 8:
    raise DataError(f"--vocab_size={vocab_size} is too small; use e.g. 4096")
  lines = list(corpus_lines(input_glob))
  if not lines:
    raise DataError(
        f"files matching '{input_glob}' hold no text; point --input_glob at text")
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
