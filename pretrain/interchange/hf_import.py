"""Reading a transformers RecurrentGemma checkpoint: `pretrain.convert hf`'s input side.

A checkpoint is a directory holding `config.json` and safetensors weights (one file, or
shards with `model.safetensors.index.json`), as `save_pretrained` and `pretrain.export`
write it, or a Hugging Face hub cache entry (`models--ORG--NAME`, whose `refs/main`
names the snapshot to read). Weights are read on the host into float32 numpy arrays
(bfloat16 through ml_dtypes), so no torch is needed.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import numpy as np

from plumbing.errors import UserError

BYTE_TOKENIZER_SIZE = 259   # pad, EOS, UNK and 256 bytes


def resolve_checkpoint(path: str) -> str:
  """The directory holding config.json: `path` itself or its hub-cache snapshot."""
  if os.path.isfile(os.path.join(path, "config.json")):
    return path
  snapshots = os.path.join(path, "snapshots")
  if os.path.isdir(snapshots):
    ref = os.path.join(path, "refs", "main")
    if os.path.isfile(ref):
      with open(ref) as f:
        candidate = os.path.join(snapshots, f.read().strip())
      if os.path.isfile(os.path.join(candidate, "config.json")):
        return candidate
    found = sorted((os.path.getmtime(os.path.join(snapshots, name)), name)
                   for name in os.listdir(snapshots)
                   if os.path.isfile(os.path.join(snapshots, name, "config.json")))
    if found:
      return os.path.join(snapshots, found[-1][1])
  raise UserError(f"--checkpoint {path} holds no config.json (expected a directory written "
                  "by save_pretrained or pretrain.export, or a hub cache models--ORG--NAME)")


def read_config(directory: str) -> dict[str, Any]:
  with open(os.path.join(directory, "config.json")) as f:
    return json.load(f)


def weight_files(directory: str) -> list[str]:
  """The safetensors files of a checkpoint, sharded or not."""
  index = os.path.join(directory, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index) as f:
      names = sorted(set(json.load(f)["weight_map"].values()))
    return [os.path.join(directory, name) for name in names]
  single = os.path.join(directory, "model.safetensors")
  if os.path.isfile(single):
    return [single]
  raise UserError(f"{directory} has no model.safetensors (nor an index of shards); only "
                  "safetensors checkpoints are read")


def read_weights(directory: str) -> dict[str, np.ndarray]:
  """Every tensor of the checkpoint as float32 numpy, by name."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  state: dict[str, np.ndarray] = {}
  for path in weight_files(directory):
    state.update({name: value.astype(np.float32) for name, value in load_file(path).items()})
  return state


def vocabulary_source(directory: str) -> Optional[str]:
  """'byte', a SentencePiece model path, a `tokenizer.json` path, or None without either.

  A `tokenizer.model` (SentencePiece; Google's checkpoints and our SentencePiece
  exports ship it) wins; a `tokenizer.json` holding exactly the byte table of
  `pretrain.interchange.hf_tokenizer` means the byte vocabulary; any other
  `tokenizer.json` is the model's own vocabulary (`get_vocabulary.tokenizer_json`).
  """
  model = os.path.join(directory, "tokenizer.model")
  if os.path.isfile(model):
    return model
  tokenizer = os.path.join(directory, "tokenizer.json")
  if os.path.isfile(tokenizer):
    with open(tokenizer) as f:
      spec = json.load(f).get("model", {})
    vocab = spec.get("vocab", {})
    if (spec.get("type") == "BPE" and len(vocab) == BYTE_TOKENIZER_SIZE
        and not spec.get("merges") and vocab.get("<pad>") == 0 and vocab.get("</s>") == 1):
      return "byte"
    return tokenizer
  return None


def eos_token(directory: str) -> Optional[str]:
  """The EOS token `tokenizer_config.json` names (a string or an AddedToken's fields),
  when it names one."""
  path = os.path.join(directory, "tokenizer_config.json")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    token = json.load(f).get("eos_token")
  if isinstance(token, dict):
    token = token.get("content")
  return token if isinstance(token, str) and token else None


def model_max_length(directory: str) -> Optional[int]:
  """tokenizer_config.json's model_max_length when it is a real length."""
  path = os.path.join(directory, "tokenizer_config.json")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    length = json.load(f).get("model_max_length")
  return int(length) if isinstance(length, (int, float)) and 0 < length < 10 ** 7 else None
