r"""Imports a RecurrentGemma Flax or transformers checkpoint as a step-0 run directory:
the library of `python -m pretrain.convert` (whose docstring says what is read and
written).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from model import hf_params
from model import recurrentgemma_params as rg
from model.config import ModelConfig, model_config_to_dict
from plumbing import cli
from plumbing import storage
from plumbing.errors import UserError, usage_error
from pretrain import extras
from pretrain.interchange import hf_import
from pretrain.checkpoints.persistent import (PersistentTier, complete_steps,
                                             describe_mismatch, shapes_by_path)
from pretrain.checkpoints.metadata import RunMetadata, make_vocabulary, vocabulary_spec
from pretrain.data.vocabularies import get_vocabulary
from pretrain.run_directory import RunDirectory
from pretrain.runtime import Runtime
from sharding.mesh import MeshConfig


FORMATS = ("recurrentgemma", "hf")


def flag_settings(window: Optional[str], logits_soft_cap: Optional[float],
                  scale: Optional[bool]) -> dict[str, Any]:
  missing = [name for name, value in (("--window", window),
                                      ("--logits_soft_cap", logits_soft_cap),
                                      ("--embeddings_scale_by_sqrt_dim", scale))
             if value is None]
  if missing:
    raise usage_error(
        f"Give --preset=NAME (e.g. recurrentgemma_2b) or all of --window, "
        f"--logits_soft_cap and --embeddings_scale_by_sqrt_dim; missing {missing}")
  if window.lower() in ("none", "global"):
    window_value = None
  else:
    try:
      window_value = int(window)
    except ValueError:
      raise usage_error(f"--window must be an integer or 'none', got {window!r}") from None
  return dict(window=window_value, logits_soft_cap=logits_soft_cap or None,
              embeddings_scale_by_sqrt_dim=scale)


def read_recurrentgemma(path: str) -> dict:
  """The checkpoint's tree as host numpy arrays (no accelerator memory used)."""
  if not os.path.isdir(path):
    raise UserError(f"--checkpoint {path} is not a directory (expected an Orbax "
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
    raise UserError(f"Cannot read the RecurrentGemma checkpoint {path}: "
                        f"{str(error).splitlines()[0]}") from None


def model_gin(config: ModelConfig) -> str:
  """ModelConfig bindings reproducing `config`, for training on from the checkpoint."""
  lines = ["# Written by pretrain.convert: the imported model's shape.", "import model.config", ""]
  for name, value in model_config_to_dict(config).items():
    if isinstance(value, list):
      value = tuple(value)
    lines.append(f"ModelConfig.{name} = {value!r}")
  return "\n".join(lines) + "\n"


def convert_recurrentgemma(checkpoint: str, workdir: str, settings: dict[str, Any],
                           vocab: str = "byte", sequence_length: int = 2048) -> ModelConfig:
  """Writes DIR/checkpoints/0 (and DIR/model.gin); returns the ModelConfig."""
  tree = read_recurrentgemma(checkpoint)
  try:
    config = rg.config_from_recurrentgemma_params(tree, **settings)
    params = rg.recurrentgemma_to_ours(tree, config)
  except (KeyError, ValueError) as error:
    raise UserError(f"{checkpoint} is not a RecurrentGemma parameter tree this "
                        f"converter understands: {error}") from None
  write_step0(workdir, config, params, make_vocabulary(vocab), sequence_length)
  return config


def write_step0(workdir: str, config: ModelConfig, params: Any, vocabulary: Any,
                sequence_length: int) -> None:
  """Saves `params` (numpy, ours) as checkpoint 0 of a new `workdir`, plus model.gin."""
  if vocabulary.vocab_size > config.vocab_size:
    raise UserError(f"--vocab has {vocabulary.vocab_size} ids but the checkpoint's "
                        f"embedding only {config.vocab_size} rows; pass the vocabulary "
                        "the model was trained with")
  run = RunDirectory(workdir)
  workdir = run.root
  cli.prepare_workdir(workdir)
  if complete_steps(run.checkpoints):
    raise UserError(f"{workdir} already holds checkpoints; convert into a new --workdir")
  runtime = Runtime.create(config, MeshConfig())
  problem = describe_mismatch(shapes_by_path(params), shapes_by_path(runtime.abstract_params))
  if problem:
    raise UserError(f"The converted parameters do not fit the model they imply:\n{problem}")
  sharded = jax.tree.map(jax.device_put, params, runtime.param_shardings)
  checkpointer = PersistentTier(run)
  try:
    checkpointer.save(0, params=sharded, opt_state=None, rng=jax.random.key(0),
                      metadata=RunMetadata(config, vocabulary_spec(vocabulary, workdir),
                                           sequence_length).to_json())
  finally:
    checkpointer.close()
  if jax.process_index() == 0:
    storage.write_text(run.model_gin, model_gin(config))


def convert_hf(checkpoint: str, workdir: str, vocab: Optional[str] = None,
               sequence_length: Optional[int] = None) -> ModelConfig:
  """Writes DIR/checkpoints/0 (and DIR/model.gin) from a transformers checkpoint."""
  extras.require("safetensors", extra="hf", purpose="import a Hugging Face checkpoint")
  directory = hf_import.resolve_checkpoint(checkpoint)
  try:
    config = hf_params.config_from_hf(hf_import.read_config(directory))
    params = hf_params.hf_to_ours(hf_import.read_weights(directory), config)
  except (KeyError, ValueError) as error:
    raise UserError(f"{directory} is not a transformers RecurrentGemma checkpoint this "
                    f"converter understands: {error}") from None
  vocab = vocab or hf_import.vocabulary_source(directory)
  if vocab is None:
    raise usage_error(f"{directory} has no tokenizer.model or tokenizer.json: pass "
                      "--vocab=byte, --vocab=PATH.model or --vocab=PATH/tokenizer.json")
  length = sequence_length or hf_import.model_max_length(directory) or 2048
  write_step0(workdir, config, params, _vocabulary(vocab), length)
  return config


def _vocabulary(vocab: str) -> Any:
  """The vocabulary of a --vocab value: 'byte', a SentencePiece `.model`, or a
  `tokenizer.json` whose EOS is the one its directory's `tokenizer_config.json` names
  (else found by name, `pretrain.data.hf_vocabulary`)."""
  if not vocab.endswith(".json"):
    return make_vocabulary(vocab)
  return get_vocabulary(tokenizer_json=vocab,
                        eos_token=hf_import.eos_token(os.path.dirname(vocab)))
