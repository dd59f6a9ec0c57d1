r"""Trains a vocabulary on a corpus: SentencePiece, or a byte-level BPE `tokenizer.json`.

  python -m pretrain.tokenizer --input_glob='{stdlib}/**/*.py' --vocab_size=4096 \
      --output=/tmp/spm.model
  python -m pretrain.tokenizer --model_type=byte_level_bpe --input_glob=corpus/web \
      --vocab_size=32768 --output=corpus/tokenizer

The first writes a SentencePiece model: train with it through
`--gin_param="get_vocabulary.spm_path='/tmp/spm.model'"`. The second writes
`corpus/tokenizer/tokenizer.json` (or the `.json` file --output names), a GPT-2 style
byte-level BPE trained with Hugging Face `tokenizers`: train with it through
`--gin_param="get_vocabulary.tokenizer_json='corpus/tokenizer'"`. Either way set
`ModelConfig.vocab_size` (`VOCAB_SIZE`) to at least the vocabulary's size.

--input_glob is a corpus as `configs/data/corpus.gin` reads it (Parquet, `.jsonl`,
`.jsonl.gz`, `.jsonl.zst`, a `datasets` save_to_disk directory; a glob, a directory or
one file, local or gs:// / s3://; --text_field names the column or field), or else a
glob read like the text-files task's (`{stdlib}` placeholder, one document per file,
`.jsonl` files contributing their --text_field). Both kinds keep text exactly and use
the ids the pipeline expects, so they need no further settings: SentencePiece with no
Unicode normalisation, whitespace kept, unknown characters falling back to bytes, and
0 = padding, 1 = EOS, 2 = UNK, no BOS; the byte-level BPE encodes any text (no UNK),
with `<pad>` = 0 (padding and the document-start input) and `<|endoftext|>` = 1 (EOS).
"""
from __future__ import annotations

from typing import Sequence

from absl import flags

from plumbing import cli
from pretrain.interchange.tokenizer import train_byte_level_bpe, train_sentencepiece

FLAGS = flags.FLAGS
BYTE_LEVEL_BPE = "byte_level_bpe"


def define_flags() -> None:
  """Command-line flags, defined only when run as a program so that importing this
  module next to other entry points (tests, notebooks) cannot clash."""
  flags.DEFINE_string(
      "input_glob", None, "Corpus to train on: Parquet / .jsonl[.gz|.zst] / save_to_disk "
      "(a glob, directory or file, local or gs:// / s3://), or a glob of text files "
      "(recursive **, {stdlib} placeholder).")
  flags.DEFINE_integer("vocab_size", None, "Number of pieces (at least 8; 258 for "
                       "byte_level_bpe).", lower_bound=8)
  flags.DEFINE_string(
      "output", None, "SentencePiece: model path, `.model` appended if missing (a "
      "`.vocab` listing is written next to it). byte_level_bpe: a directory to hold "
      "tokenizer.json, or a path ending in .json.")
  flags.DEFINE_enum("model_type", "bpe", ["unigram", "bpe", BYTE_LEVEL_BPE],
                    "unigram or bpe: a SentencePiece model; byte_level_bpe: a Hugging "
                    "Face tokenizer.json (GPT-2 style, trained with `tokenizers`).")
  flags.DEFINE_string("text_field", "text", "The column or JSON field holding each "
                      "document (Parquet, JSONL, save_to_disk corpora).")
  flags.DEFINE_integer(
      "max_lines", 2_000_000, "SentencePiece: lines sampled (evenly) from the corpus for "
      "training. A byte-level BPE streams every document.", lower_bound=1)
  for name in ("input_glob", "vocab_size", "output"):
    flags.mark_flag_as_required(name)


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  if FLAGS.model_type == BYTE_LEVEL_BPE:
    path = train_byte_level_bpe(FLAGS.input_glob, FLAGS.vocab_size, FLAGS.output,
                                FLAGS.text_field)
  else:
    path = train_sentencepiece(FLAGS.input_glob, FLAGS.vocab_size, FLAGS.output,
                               FLAGS.model_type, FLAGS.max_lines, FLAGS.text_field)
  print(f"wrote {path}")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
