r"""Writes a trained checkpoint as a Hugging Face model directory: the library of
`python -m pretrain.export` (whose docstring lists the files written).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Any, Optional

import jax
import ml_dtypes
import numpy as np

from model import hf_params
from plumbing import storage
from plumbing.errors import UserError, usage_error
from pretrain import extras
from pretrain.data import hf_vocabulary
from pretrain.interchange import hf_tokenizer
from pretrain.interchange import safetensors_writer
from pretrain.checkpoints.loading import LoadedModel, load
from pretrain.run_directory import RunDirectory


DTYPES = ("float32", "bfloat16")
MAX_SHARD_BYTES = 5 * 2 ** 30
REMOTE_CODE_DIR = os.path.join(os.path.dirname(__file__), "hf_remote")
REMOTE_CODE_FILES = ("configuration_griffin.py", "modeling_griffin.py")


def _shards(state: dict[str, np.ndarray], dtype: np.dtype,
            max_bytes: int) -> list[dict[str, np.ndarray]]:
  """The tensors split, in order, into groups of at most `max_bytes` (one if it fits)."""
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, value in state.items():
    value_bytes = safetensors_writer.nbytes(value, dtype)
    if shards[-1] and size + value_bytes > max_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = value
    size += value_bytes
  return shards


def write_weights(state: dict[str, np.ndarray], directory: str, dtype: str = "float32",
                  max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
  """Writes `model.safetensors`, or numbered shards plus the index transformers reads;
  each tensor is cast to `dtype` as it is written."""
  np_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
  shards = _shards(state, np_dtype, max_shard_bytes)
  if len(shards) == 1:
    names = ["model.safetensors"]
  else:
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
             for i in range(len(shards))]
  for name, shard in zip(names, shards):
    safetensors_writer.write(os.path.join(directory, name), shard, np_dtype,
                             {"format": "pt"})
  if len(shards) > 1:
    total = sum(safetensors_writer.nbytes(value, np_dtype) for value in state.values())
    index = {"metadata": {"total_size": total},
             "weight_map": {tensor: name for name, shard in zip(names, shards)
                            for tensor in shard}}
    _write_json(os.path.join(directory, "model.safetensors.index.json"), index)
  return names


def _write_json(path: str, values: Any) -> None:
  with open(path, "w") as f:
    json.dump(values, f, indent=2, sort_keys=True)
    f.write("\n")


def _run_summary(workdir: str) -> dict[str, Any]:
  """Final train/eval losses from metrics.jsonl and the run's config.gin, when present."""
  summary: dict[str, Any] = {}
  run = RunDirectory(workdir)
  metrics = run.metrics
  if storage.exists(metrics):
    for line in storage.read_text(metrics).splitlines():
      try:
        row = json.loads(line)
      except ValueError:
        continue
      for key in ("loss", "eval_loss", "eval_bits_per_byte"):
        if row.get(key) is not None and "kind" not in row:
          summary[key] = (row["step"], row[key])
  config = run.config
  if storage.exists(config):
    summary["config_gin"] = storage.read_text(config)
  return summary


def _tokens_trained(config_gin: str, step: int) -> Optional[int]:
  """step × BATCH_SIZE × SEQUENCE_LENGTH when the operative config states both macros."""
  values = {}
  for macro in ("BATCH_SIZE", "SEQUENCE_LENGTH"):
    match = re.search(rf"^{macro}\s*=\s*(\d+)\s*$", config_gin, re.MULTILINE)
    if not match:
      return None
    values[macro] = int(match.group(1))
  return step * values["BATCH_SIZE"] * values["SEQUENCE_LENGTH"]


def model_card(model: LoadedModel, hf_config: dict[str, Any], dtype: str,
               summary: dict[str, Any], remote_code: bool, has_tokenizer: bool) -> str:
  """README.md of the export: what was trained, how far, how well, and how to load it."""
  cfg = model.config
  family = ("Hawk" if cfg.block_pattern == ("recurrent",) else
            "MQA Transformer" if cfg.block_pattern == ("attention",) else "Griffin")
  trust = ", trust_remote_code=True" if remote_code else ""
  lines = ["---", "library_name: transformers", "tags:", "- griffin-pretrain",
           f"- {family.split()[0].lower()}", "pipeline_tag: text-generation", "---", "",
           f"# {family} ({cfg.width} wide, {cfg.depth} layers) trained with griffin-pretrain",
           "",
           f"Exported from checkpoint step {model.step} as {dtype} weights for transformers' "
           f"`{hf_config['architectures'][0]}`.", "",
           "| | |", "| --- | --- |",
           f"| block pattern | {', '.join(cfg.block_pattern)} |",
           f"| width / RNN width / MLP width | {cfg.width} / {cfg.rnn_width} / {cfg.mlp_width} |",
           f"| heads / RG-LRU gate blocks | {cfg.num_heads} / {cfg.gate_blocks} |",
           f"| local attention window | {cfg.attention_window or 'global'} |",
           f"| vocabulary | {model.vocabulary_spec} ({cfg.vocab_size} ids) |",
           f"| training sequence length | {model.sequence_length} |",
           f"| steps | {model.step} |"]
  tokens = _tokens_trained(summary.get("config_gin", ""), model.step)
  if tokens is not None:
    lines.append(f"| tokens | {tokens:,} |")
  for key, label in (("loss", "final train loss (nats/token)"),
                     ("eval_loss", "final validation loss (nats/token)"),
                     ("eval_bits_per_byte", "final validation bits per byte")):
    if key in summary:
      step, value = summary[key]
      lines.append(f"| {label} | {value:.4f} (step {step}) |")
  lines += ["", "```python", "import torch",
            "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
            f'model = AutoModelForCausalLM.from_pretrained("DIR"{trust})']
  if has_tokenizer:
    # AutoTokenizer reads config.json too: without the flag it asks on the terminal.
    lines += [f'tokenizer = AutoTokenizer.from_pretrained("DIR"{trust})',
              'ids = tokenizer("def main(", return_tensors="pt").input_ids',
              "print(tokenizer.decode(model.generate(ids, max_new_tokens=32, "
              "do_sample=False)[0], skip_special_tokens=True))"]
  lines += ["```", "",
            "The tokenizer starts every text with id 0, the document-start input the model "
            "was trained with."]
  if not hf_config["use_cache"]:
    lines.append("Without attention layers the model has no transformers cache "
                 "(`use_cache: false`: it cannot count the tokens of recurrent-only models), "
                 "so `generate` recomputes the whole text for each new token: slower, same "
                 "tokens.")
  lines.append("")
  if "config_gin" in summary:
    lines += ["## Training config (the run's operative Gin config)", "", "```",
              summary["config_gin"].rstrip(), "```", ""]
  return "\n".join(lines)


def generation_config(hf_config: dict[str, Any]) -> dict[str, Any]:
  """generation_config.json: what `generate` and `pipeline` use when given no flags.

  `use_cache` repeats config.json's (`model(ids)` reads that one, `generate` this one).
  The pad id is EOS, not config.json's 0: given no attention mask, `generate` masks
  every input equal to the pad id unless pad = EOS, and id 0 is the document start the
  tokenizer puts first, which attention layers must see.
  """
  eos = hf_config["eos_token_id"]
  return {"bos_token_id": hf_config["bos_token_id"], "eos_token_id": eos,
          "pad_token_id": eos, "use_cache": hf_config["use_cache"]}


def _write_export(model: LoadedModel, directory: str, dtype: str) -> dict[str, Any]:
  """Writes every file of the export into the local `directory`; returns the config.

  The weights stream to disk one tensor at a time (`pretrain.interchange.safetensors_writer`), each
  transposed and cast only while it is written, so a large model is not held twice.
  """
  hf_config = hf_params.hf_config(model.config)
  hf_config["torch_dtype"] = dtype
  if isinstance(model.vocabulary, hf_vocabulary.HfTokenizerVocabulary):
    hf_config["eos_token_id"] = model.vocabulary.eos_id   # its own, not the byte one's 1
  state = hf_params.ours_to_hf(jax.device_get(model.params), model.config)
  model.params = None   # the mapped tree (views where no copy is needed) holds them
  write_weights(state, directory, dtype)
  del state
  _write_json(os.path.join(directory, "config.json"), hf_config)
  _write_json(os.path.join(directory, "generation_config.json"), generation_config(hf_config))
  remote_code = hf_params.gate_blocks_need_remote_code(model.config)
  if remote_code:
    for name in REMOTE_CODE_FILES:
      shutil.copy(os.path.join(REMOTE_CODE_DIR, name), directory)
  has_tokenizer = hf_tokenizer.save(model.vocabulary, directory,
                                    model_max_length=model.sequence_length)
  summary = _run_summary(model.workdir) if model.workdir else {}
  with open(os.path.join(directory, "README.md"), "w") as f:
    f.write(model_card(model, hf_config, dtype, summary, remote_code, has_tokenizer))
  return hf_config


def _check_output(output: str) -> None:
  if storage.listdir(output):
    raise usage_error(f"--output {output} is not empty; export into a new directory "
                      "(or delete it first)")


def export(workdir: str, output: str, step: Optional[int] = None,
           dtype: str = "float32") -> dict[str, Any]:
  """Exports `workdir`'s checkpoint (newest or `step`) to `output`; returns config.json."""
  extras.require("safetensors", "tokenizers", extra="hf", purpose="export to Hugging Face")
  if dtype not in DTYPES:
    raise usage_error(f"--dtype must be one of {DTYPES}, got {dtype!r}")
  output = storage.resolve(output)
  _check_output(output)
  model = load(workdir, step)
  try:
    hf_params.check_exportable(model.config)
  except ValueError as error:
    raise UserError(f"Cannot export {workdir}: {error}") from None
  if jax.process_index() != 0:
    return hf_params.hf_config(model.config)
  if storage.is_url(output):
    with tempfile.TemporaryDirectory(prefix="griffin-export-") as staging:
      hf_config = _write_export(model, staging, dtype)
      storage.upload_tree(staging, output)
    return hf_config
  os.makedirs(output, exist_ok=True)
  return _write_export(model, output, dtype)
