r"""A trained checkpoint as a Hugging Face model directory.

  python -m pretrain.export --workdir=DIR|gs://… [--step=N] --output=DIR|gs://… \
      [--dtype=float32|bfloat16]

The output loads with `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)`:

  config.json, generation_config.json   transformers' RecurrentGemma config (model.hf_params)
                                        and what generate needs without flags
  model.safetensors                     the weights (sharded with an index past 5 GiB)
  tokenizer.json, tokenizer_config.json the run's vocabulary (pretrain.interchange.hf_tokenizer)
  configuration_griffin.py, modeling_griffin.py
                                        only for Griffin models whose RG-LRU gate blocks
                                        differ from their heads: load with
                                        trust_remote_code=True (pretrain/interchange/hf_remote/)
  README.md                             a model card: training config, steps, tokens, losses

Griffin, Hawk and MQA export; CG-LRU and GateLoop stop with one line saying why. Writing
needs only safetensors and tokenizers (the `hf` extra); loading needs torch.
"""
from __future__ import annotations

from typing import Sequence

from absl import flags

from plumbing import cli
from pretrain.interchange.hf_export import DTYPES, export

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string("workdir", None, "Run directory (or gs:// / s3:// URL) to export.")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).", lower_bound=0)
  flags.DEFINE_string("output", None, "New directory (or URL) for the Hugging Face model.")
  flags.DEFINE_enum("dtype", "float32", DTYPES, "Dtype of the exported weights.")
  flags.mark_flags_as_required(["workdir", "output"])


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  hf_config = export(FLAGS.workdir, FLAGS.output, FLAGS.step, FLAGS.dtype)
  trust = ", trust_remote_code=True" if "auto_map" in hf_config else ""
  print(f"Exported {FLAGS.workdir} -> {FLAGS.output} ({hf_config['architectures'][0]}, "
        f"{FLAGS.dtype}). Load it with AutoModelForCausalLM.from_pretrained("
        f"{FLAGS.output!r}{trust}).")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
