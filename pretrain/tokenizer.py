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

from typing import Sequence

from absl import flags

from plumbing import cli
from pretrain.interchange.tokenizer import train_sentencepiece

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


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  path = train_sentencepiece(FLAGS.input_glob, FLAGS.vocab_size, FLAGS.output,
                             FLAGS.model_type, FLAGS.max_lines)
  print(f"wrote {path}")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
