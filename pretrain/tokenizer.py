r"""Trains a SentencePiece vocabulary on local text files.

  python -m pretrain.tokenizer --input_glob='{stdlib}/**/*.py' --vocab_size=4096 \
      --output=/tmp/spm.model

Then train with it: `--gin_param="get_vocabulary.spm_path='/tmp/spm.model'"` (and
`text_files_task.vocabulary = @get_vocabulary()` in the data config).

The input glob is read like the text-files task's (`{stdlib}` placeholder, `.jsonl`
files contribute their `text` fields). The model keeps text exactly (no Unicode
normalisation, whitespace and indentation preserved, unknown characters fall back to
bytes) and uses the ids the pipeline expects: 0 = padding, 1 = EOS, 2 = UNK, no BOS.
"""
from __future__ import annotations

import io
import os
from typing import Iterator, Sequence

from absl import flags
import sentencepiece as spm

from plumbing import cli
from plumbing import storage
from pretrain.data import corpus_files
from pretrain.data.errors import DataError

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Command-line flags, defined only when run as a program so that importing this
  module next to other entry points (tests, notebooks) cannot clash."""
  flags.DEFINE_string(
      "input_glob", None, "Files to train on (recursive **, {stdlib} placeholder).")
  flags.DEFINE_integer("vocab_size", None, "Number of pieces (at least 8).", lower_bound=8)
  flags.DEFINE_string(
      "output", None, "Model path; `.model` is appended if missing (a `.vocab` "
      "listing is written next to it).")
  flags.DEFINE_enum("model_type", "bpe", ["unigram", "bpe"], "SentencePiece algorithm.")
  flags.DEFINE_integer(
      "max_lines", 2_000_000, "Lines sampled (evenly) from the corpus for training.",
      lower_bound=1)
  for name in ("input_glob", "vocab_size", "output"):
    flags.mark_flag_as_required(name)


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


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  path = train_sentencepiece(FLAGS.input_glob, FLAGS.vocab_size, FLAGS.output,
                             FLAGS.model_type, FLAGS.max_lines)
  print(f"wrote {path}")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
