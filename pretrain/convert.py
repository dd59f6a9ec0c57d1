r"""Imports a RecurrentGemma Flax checkpoint as a step-0 checkpoint of ours.

  python -m pretrain.convert recurrentgemma --checkpoint=PATH --workdir=DIR \
      [--preset=NAME | --window=W --logits_soft_cap=C --embeddings_scale_by_sqrt_dim=BOOL] \
      [--vocab=byte|PATH.model]

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
from typing import Any, Optional, Sequence

from absl import flags

from pretrain import cli

FLAGS = flags.FLAGS
FORMATS = ("recurrentgemma",)


def define_flags() -> None:
  flags.DEFINE_string("checkpoint", None, "RecurrentGemma Orbax checkpoint directory.")
  flags.DEFINE_string("workdir", None, "Run directory to create the step-0 checkpoint in.")
  flags.DEFINE_string("preset", None, "Model preset (configs/models/NAME.gin) supplying "
                      "the window, soft cap and embedding scaling.")
  flags.DEFINE_string("window", None, "Local attention window; 'none' = global.")
  flags.DEFINE_float("logits_soft_cap", None, "Logit soft cap c; 0 disables.")
  flags.DEFINE_bool("embeddings_scale_by_sqrt_dim", None, "Scale embeddings by sqrt(D).")
  flags.DEFINE_string("vocab", "byte", "'byte' or a SentencePiece .model path.")
  flags.DEFINE_integer("sequence_length", 2048, "Chunk length evaluate uses for text files.")


def preset_settings(name: str) -> dict[str, Any]:
  """window / logits_soft_cap / embeddings_scale_by_sqrt_dim of a model preset Gin file."""
  import gin  # pylint: disable=g-import-not-at-top
  from model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  path = os.path.join(cli.REPO_ROOT, "configs", "models", f"{name}.gin")
  if not os.path.exists(path):
    known = sorted(f[:-4] for f in os.listdir(os.path.dirname(path)) if f.endswith(".gin"))
    raise cli.ConfigError(f"Unknown --preset {name!r}; known presets: {', '.join(known)}")
  gin.clear_config()
  cli.parse_gin([path], [])
  preset = ModelConfig()
  gin.clear_config()
  return dict(window=preset.attention_window, logits_soft_cap=preset.logits_soft_cap,
              embeddings_scale_by_sqrt_dim=preset.embeddings_scale_by_sqrt_dim)


def flag_settings(window: Optional[str], logits_soft_cap: Optional[float],
                  scale: Optional[bool]) -> dict[str, Any]:
  missing = [name for name, value in (("--window", window),
                                      ("--logits_soft_cap", logits_soft_cap),
                                      ("--embeddings_scale_by_sqrt_dim", scale))
             if value is None]
  if missing:
    raise cli.ConfigError(
        f"Give --preset=NAME (e.g. recurrentgemma_2b) or all of --window, "
        f"--logits_soft_cap and --embeddings_scale_by_sqrt_dim; missing {missing}")
  if window.lower() in ("none", "global"):
    window_value = None
  else:
    try:
      window_value = int(window)
    except ValueError:
      raise cli.ConfigError(f"--window must be an integer or 'none', got {window!r}") from None
  return dict(window=window_value, logits_soft_cap=logits_soft_cap or None,
              embeddings_scale_by_sqrt_dim=scale)


def read_recurrentgemma(path: str) -> dict:
  """The checkpoint's tree as host numpy arrays (no accelerator memory used)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  if not os.path.isdir(path):
    raise cli.UserError(f"--checkpoint {path} is not a directory (expected an Orbax "
                        "checkpoint written by recurrentgemma.jax.utils.save_parameters)")
  checkpointer = ocp.PyTreeCheckpointer()
  try:
    metadata = checkpointer.metadata(path)
    metadata = getattr(metadata, "item_metadata", metadata)   # StepMetadata -> tree
    tree = getattr(metadata, "tree", metadata)
    def host_args(node):  # a RestoreArgs per array leaf of the nested dicts
      if isinstance(node, dict):
        return {key: host_args(value) for key, value in node.items()}
      return ocp.RestoreArgs(restore_type=np.ndarray)
    return checkpointer.restore(path, args=ocp.args.PyTreeRestore(
        restore_args=host_args(dict(tree))))
  except (FileNotFoundError, ValueError) as error:
    raise cli.UserError(f"Cannot read the RecurrentGemma checkpoint {path}: "
                        f"{str(error).splitlines()[0]}") from None


def model_gin(config: Any) -> str:
  """ModelConfig bindings reproducing `config`, for training on from the checkpoint."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  lines = ["# Written by pretrain.convert: the imported model's shape.", "import model.config", ""]
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    lines.append(f"ModelConfig.{field.name} = {value!r}")
  return "\n".join(lines) + "\n"


def convert_recurrentgemma(checkpoint: str, workdir: str, settings: dict[str, Any],
                           vocab: str = "byte", sequence_length: int = 2048) -> Any:
  """Writes DIR/checkpoints/0 (and DIR/model.gin); returns the ModelConfig."""
  import jax  # pylint: disable=g-import-not-at-top
  from model import recurrentgemma_params as rg  # pylint: disable=g-import-not-at-top
  from pretrain import load as load_lib  # pylint: disable=g-import-not-at-top
  from pretrain.checkpointing import (  # pylint: disable=g-import-not-at-top
      Checkpointer, complete_steps, describe_mismatch, shapes_by_path)
  from pretrain.trainer import Setup  # pylint: disable=g-import-not-at-top

  tree = read_recurrentgemma(checkpoint)
  try:
    config = rg.config_from_recurrentgemma_params(tree, **settings)
    params = rg.recurrentgemma_to_ours(tree, config)
  except (KeyError, ValueError) as error:
    raise cli.UserError(f"{checkpoint} is not a RecurrentGemma parameter tree this "
                        f"converter understands: {error}") from None
  vocabulary = load_lib.make_vocabulary(vocab)
  if vocabulary.vocab_size > config.vocab_size:
    raise cli.UserError(f"--vocab has {vocabulary.vocab_size} ids but the checkpoint's "
                        f"embedding only {config.vocab_size} rows; pass the vocabulary "
                        "the model was trained with")
  os.makedirs(workdir, exist_ok=True)
  if complete_steps(os.path.join(workdir, "checkpoints")):
    raise cli.UserError(f"{workdir} already holds checkpoints; convert into a new --workdir")
  setup = Setup(config)
  problem = describe_mismatch(shapes_by_path(params), shapes_by_path(setup.abstract_params))
  if problem:
    raise cli.UserError(f"The converted parameters do not fit the model they imply:\n{problem}")
  sharded = jax.tree.map(jax.device_put, params, setup.param_shardings)
  checkpointer = Checkpointer(workdir)
  try:
    checkpointer.save(0, params=sharded, opt_state=None, rng=jax.random.key(0),
                      metadata={"model_config": load_lib.model_config_to_dict(config),
                                "vocabulary": load_lib.vocabulary_spec(vocabulary),
                                "sequence_length": sequence_length})
  finally:
    checkpointer.close()
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "model.gin"), "w", encoding="utf-8") as f:
      f.write(model_gin(config))
  return config


def main(argv: Sequence[str]) -> None:
  if len(argv) != 2 or argv[1] not in FORMATS:
    raise cli.ConfigError(f"Usage: python -m pretrain.convert {{{'|'.join(FORMATS)}}} "
                          "--checkpoint=PATH --workdir=DIR [--preset=NAME | --window=W "
                          "--logits_soft_cap=C --embeddings_scale_by_sqrt_dim=BOOL]")
  for name in ("checkpoint", "workdir"):
    if not FLAGS[name].value:
      raise cli.ConfigError(f"--{name} is required")
  if FLAGS.preset:
    given = [n for n in ("window", "logits_soft_cap", "embeddings_scale_by_sqrt_dim")
             if FLAGS[n].present]
    if given:
      raise cli.ConfigError(f"--preset and {['--' + n for n in given]} exclude each other")
    settings = preset_settings(FLAGS.preset)
  else:
    settings = flag_settings(FLAGS.window, FLAGS.logits_soft_cap,
                             FLAGS.embeddings_scale_by_sqrt_dim)
  config = convert_recurrentgemma(FLAGS.checkpoint, FLAGS.workdir, settings,
                                  FLAGS.vocab, FLAGS.sequence_length)
  print(f"Converted {FLAGS.checkpoint} -> {FLAGS.workdir}/checkpoints/0 "
        f"(width {config.width}, depth {config.depth}, pattern {config.block_pattern}). "
        f"Continue training with --gin_file={FLAGS.workdir}/model.gin plus a data config.")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
