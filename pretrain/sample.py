r"""Samples a continuation of a prompt from a trained model.

  python -m pretrain.sample --workdir=DIR --prompt='def ' [--max_new_tokens=200] \
      [--temperature=0.8] [--seed=0]

See `pretrain.evaluation.generation` for how decoding works (one prefill, then cached steps).
"""
from __future__ import annotations

from typing import Sequence

from absl import flags

from plumbing import cli
from pretrain.evaluation.generation import sample_text
from pretrain.checkpoints.loading import load

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of the command (defined only when run as one)."""
  flags.DEFINE_string("workdir", None, "Run directory holding checkpoints/.")
  flags.DEFINE_string("prompt", None, "Text to continue.")
  flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate.", lower_bound=1)
  flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 = greedy.",
                     lower_bound=0.0)
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).", lower_bound=0)
  flags.mark_flags_as_required(["workdir", "prompt"])


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  model = load(FLAGS.workdir, FLAGS.step)
  text = sample_text(model.config, model.params, model.vocabulary, FLAGS.prompt,
                     max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                     seed=FLAGS.seed)
  print(FLAGS.prompt + text)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
