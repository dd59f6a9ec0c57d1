r"""Imports a RecurrentGemma Flax or transformers checkpoint as a step-0 checkpoint of ours.

  python -m pretrain.convert recurrentgemma --checkpoint=PATH --workdir=DIR \
      [--preset=NAME | --window=W --logits_soft_cap=C --embeddings_scale_by_sqrt_dim=BOOL] \
      [--vocab=byte|PATH.model]
  python -m pretrain.convert hf --checkpoint=DIR|HUB_CACHE_DIR --workdir=DIR \
      [--vocab=byte|PATH.model|PATH/tokenizer.json]

hf reads a transformers RecurrentGemmaForCausalLM directory (google/recurrentgemma-2b's
layout, a `save_pretrained` output or a `pretrain.export`); its config.json says
everything, including the window and soft cap (`model.hf_params.config_from_hf`, which
also undoes the export's conventions, so export then import is bit-identical). Its
vocabulary is the checkpoint's own: `tokenizer.model` (SentencePiece) when there is one,
else its `tokenizer.json` (bytes when that is the byte table; otherwise the file itself,
EOS as `tokenizer_config.json` names it), which the run keeps in DIR/vocabulary/.

PATH is an Orbax PyTree holding {"params": ...}, as `recurrentgemma.jax.utils.
save_parameters` writes it. Widths, heads, depth, Conv1D width and block pattern are read
from the parameter shapes (`model.recurrentgemma_params`); what shapes cannot tell (local
window, logit soft cap, embedding scaling) comes from a preset (a Gin file under
configs/models/, e.g. recurrentgemma_2b) or from the three flags. The checkpoint holds
the weights and metadata but no optimizer state: `pretrain.train` on DIR starts AdamW
afresh from these weights, and `evaluate`, `sample` and `pretrain.load` use them as is.
DIR/model.gin holds the ModelConfig bindings to train with.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from absl import flags

from model.config import ModelConfig
from plumbing import cli
from plumbing.errors import usage_error
from pretrain import gin_config
from pretrain.interchange.conversion import (FORMATS, convert_hf, convert_recurrentgemma,
                                             flag_settings)

FLAGS = flags.FLAGS


def preset_settings(name: str) -> dict[str, Any]:
  """window / logits_soft_cap / embeddings_scale_by_sqrt_dim of a model preset Gin file."""
  path = os.path.join(gin_config.REPO_ROOT, "configs", "models", f"{name}.gin")
  if not os.path.exists(path):
    known = sorted(f[:-4] for f in os.listdir(os.path.dirname(path)) if f.endswith(".gin"))
    raise usage_error(f"Unknown --preset {name!r}; known presets: {', '.join(known)}")
  gin_config.parse([path], [])
  preset = gin_config.build(ModelConfig)
  return dict(window=preset.attention_window, logits_soft_cap=preset.logits_soft_cap,
              embeddings_scale_by_sqrt_dim=preset.embeddings_scale_by_sqrt_dim)


def define_flags() -> None:
  flags.DEFINE_string("checkpoint", None, "recurrentgemma: the RecurrentGemma Orbax "
                      "checkpoint directory; hf: a transformers RecurrentGemma directory "
                      "(config.json + safetensors) or a hub cache models--ORG--NAME.")
  flags.DEFINE_string("workdir", None, "Run directory to create the step-0 checkpoint in.")
  flags.DEFINE_string("preset", None, "Model preset (configs/models/NAME.gin) supplying "
                      "the window, soft cap and embedding scaling.")
  flags.DEFINE_string("window", None, "Local attention window; 'none' = global.")
  flags.DEFINE_float("logits_soft_cap", None, "Logit soft cap c; 0 disables.")
  flags.DEFINE_bool("embeddings_scale_by_sqrt_dim", None, "Scale embeddings by sqrt(D).")
  flags.DEFINE_string("vocab", None, "'byte', a SentencePiece .model path or (hf) a "
                      "tokenizer.json path. Default: byte for recurrentgemma; for hf the "
                      "checkpoint's tokenizer.model, else its tokenizer.json (byte when "
                      "that is the byte table).")
  flags.DEFINE_integer("sequence_length", 2048, "Chunk length evaluate uses for text files.",
                       lower_bound=1)
  flags.mark_flags_as_required(["checkpoint", "workdir"])


def main(argv: Sequence[str]) -> None:
  if len(argv) == 2 and argv[1] == "hf":
    given = [n for n in ("preset", "window", "logits_soft_cap", "embeddings_scale_by_sqrt_dim")
             if FLAGS[n].present]
    if given:
      raise usage_error(f"convert hf reads {['--' + n for n in given]} from config.json; "
                        "drop them")
    config = convert_hf(FLAGS.checkpoint, FLAGS.workdir, FLAGS.vocab,
                        FLAGS.sequence_length if FLAGS["sequence_length"].present else None)
  else:
    config = _convert_recurrentgemma_from_flags(argv)
  print(f"Converted {FLAGS.checkpoint} -> {FLAGS.workdir}/checkpoints/0 "
        f"(width {config.width}, depth {config.depth}, pattern {config.block_pattern}). "
        f"Continue training with --gin_file={FLAGS.workdir}/model.gin plus a data config.")


def _convert_recurrentgemma_from_flags(argv: Sequence[str]) -> ModelConfig:
  if len(argv) != 2 or argv[1] not in FORMATS:
    raise usage_error(f"Usage: python -m pretrain.convert {{{'|'.join(FORMATS)}}} "
                          "--checkpoint=PATH --workdir=DIR [--preset=NAME | --window=W "
                          "--logits_soft_cap=C --embeddings_scale_by_sqrt_dim=BOOL]")
  if FLAGS.preset:
    given = [n for n in ("window", "logits_soft_cap", "embeddings_scale_by_sqrt_dim")
             if FLAGS[n].present]
    if given:
      raise usage_error(f"--preset and {['--' + n for n in given]} exclude each other")
    settings = preset_settings(FLAGS.preset)
  else:
    settings = flag_settings(FLAGS.window, FLAGS.logits_soft_cap,
                             FLAGS.embeddings_scale_by_sqrt_dim)
  return convert_recurrentgemma(FLAGS.checkpoint, FLAGS.workdir, settings,
                                FLAGS.vocab or "byte", FLAGS.sequence_length)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
