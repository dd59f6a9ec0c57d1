"""Our models as transformers' `RecurrentGemmaForCausalLM` checkpoints, and back.

transformers ships a PyTorch Griffin (`RecurrentGemmaForCausalLM`, written from the
RecurrentGemma release), so Griffin, Hawk and MQA models leave this framework as a
`config.json` plus a flat safetensors state dict that class loads. The mapping goes
through the RecurrentGemma tree of `model.recurrentgemma_params` (which already
regroups our scanned depth into one sub-tree per layer), then renames and transposes:

    RecurrentGemma (blocks.{l}/...)           transformers (model.layers.{l}.…)
    temporal_pre_norm/scale                   temporal_pre_norm.weight
    channel_pre_norm/scale                    channel_pre_norm.weight
    mlp_block/ffw_up/w[0], w[1]  [D, M]       mlp_block.gate_proj.weight, up_proj.weight  [M, D]
    mlp_block/ffw_up/b[0,0,0], b[1,0,0]       mlp_block.gate_proj.bias, up_proj.bias
    mlp_block/ffw_down/kernel, bias           mlp_block.down_proj.weight (transposed), bias
    recurrent_block/linear_{x,y,out}          temporal_block.linear_{x,y,out} (transposed)
    recurrent_block/conv_1d/w [W, R], b       temporal_block.conv_1d.weight [R, 1, W], bias
    recurrent_block/rg_lru/a_param            temporal_block.rg_lru.recurrent_param
    recurrent_block/rg_lru/input_gate/w, b    temporal_block.rg_lru.input_gate_weight, _bias
    recurrent_block/rg_lru/a_gate/w, b        temporal_block.rg_lru.recurrent_gate_weight, _bias
    attention_block/proj_{q,k,v}/kernel       temporal_block.{q,k,v}_proj.weight (transposed)
    attention_block/proj_final/kernel, bias   temporal_block.o_proj.weight (transposed), bias
    embedder/input_embedding, final_norm      model.embed_tokens.weight, model.final_norm.weight

Where the two models' conventions differ, the export adapts the config, never the maths:

* Local attention: our layer sees keys t-w … t (w + 1 keys); transformers counts the
  current token in its window, so `attention_window_size = w + 1`. Global attention
  gets a window of `GLOBAL_WINDOW` tokens.
* Embedding scale: transformers always multiplies the embedding by √D rounded to
  bfloat16. A model that scales (RecurrentGemma) maps as is, tied. A model that does not
  exports an untied `lm_head` (our table) and an input table divided by that scale, so
  the product equals our embedding to within one rounding; import takes `lm_head` back,
  bit for bit.
* μP (`model.parametrization`): the attention queries' multiplier 1/√m is folded into
  `q_proj` (the scores are linear in W_q and RoPE is a rotation). The readout's 1/m and
  the input's √D_base cannot both live in one tied table, so a μP model of m ≠ 1
  exports untied: `lm_head` = E/m and the input table E · (its input scale) / √D, each
  within one float32 rounding (exact when m is a power of 2; the input scale is 1
  without `embeddings_scale_by_sqrt_dim`). Such an export imports back only as that
  untied table, which our tied models refuse in one line.
* No soft cap: transformers always caps, so `NO_SOFT_CAP` (c = 1e30: tanh(x/c)·c = x
  to float32 rounding).
* Decoding cache: transformers' cache counts the tokens it has seen in its attention
  layers, so a model without one (Hawk) cannot use it: `use_cache: false`, and
  transformers recomputes the whole prefix for each generated token.
* RG-LRU gate blocks: transformers uses one block per attention head. Where our gate
  blocks differ and the model has both attention and recurrent layers (every paper
  Griffin preset but 1.3B), the export needs the `trust_remote_code` subclass that
  `gate_blocks_need_remote_code` asks for (`pretrain/interchange/hf_remote/`). Hawk has no
  attention, so its head count is set to the gate blocks; MQA has no gates.

CG-LRU and GateLoop have no transformers counterpart: `check_exportable` says so, in one
line naming the block, for every block type whose registry entry declares no `hf_export`
(the optional capability of `model.block_registry`; the built-ins' are in
`model/blocks/<name>/spec.py`).
Everything here is numpy on the host.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from model import block_registry
from model import parametrization
from model import recurrentgemma_params as rg
from model.config import BlockType, ModelConfig
from model.embedder import embedding_scale

GLOBAL_WINDOW = 2 ** 30   # attention_window_size of an exported global-attention model
NO_SOFT_CAP = 1e30        # logits_soft_cap of an exported model without a cap
REMOTE_MODEL_TYPE = "griffin_gate_blocks"   # model_type of the trust_remote_code export
ROPE_THETA = 10_000.0
RMS_NORM_EPS = 1e-6


def check_exportable(config: ModelConfig) -> None:
  """Raises ValueError naming why `config` has no transformers counterpart: a block type
  whose registry entry has no `hf_export`, or a configuration of one it rejects."""
  for name in dict.fromkeys(config.block_pattern):
    block = block_registry.get(name)
    if block.hf_export is None:
      raise ValueError(f"{block.title} blocks have no transformers implementation; only "
                       "Griffin, Hawk and MQA (recurrent and attention blocks) export")
    block.hf_export.check(config)


def _has(config: ModelConfig, block_type: BlockType) -> bool:
  return block_type.value in config.block_pattern


def gate_blocks_need_remote_code(config: ModelConfig) -> bool:
  """Whether the stock class cannot hold the RG-LRU gates (blocks != attention heads)."""
  return (_has(config, BlockType.RECURRENT) and _has(config, BlockType.ATTENTION)
          and config.gate_blocks != config.num_heads)


def uses_cache(config: ModelConfig) -> bool:
  """Whether transformers can generate with its cache: DynamicCache.get_seq_length reads
  the length from the first attention layer and raises when there is none (Hawk), which
  `model(ids)` and `generate` hit with their default `use_cache=True`."""
  return _has(config, BlockType.ATTENTION)


def ties_embeddings(config: ModelConfig) -> bool:
  """Whether the export's input table is its `lm_head`: with our √D input scale (which
  transformers applies too) and no μP output multiplier other than 1."""
  return (config.embeddings_scale_by_sqrt_dim
          and parametrization.logit_multiplier(config) in (None, 1.0))


def hf_config(config: ModelConfig) -> dict[str, Any]:
  """The `config.json` fields of transformers' RecurrentGemmaConfig for `config`."""
  check_exportable(config)
  heads = config.num_heads
  if not _has(config, BlockType.ATTENTION) and _has(config, BlockType.RECURRENT):
    heads = config.gate_blocks   # Hawk: "heads" only set the gate blocks
  window = (GLOBAL_WINDOW if config.attention_window is None
            else config.attention_window + 1)
  values = {
      "model_type": "recurrent_gemma",
      "architectures": ["RecurrentGemmaForCausalLM"],
      "vocab_size": config.vocab_size,
      "hidden_size": config.width,
      "intermediate_size": 2 * config.mlp_width,   # the class halves it per branch
      "num_hidden_layers": config.depth,
      "num_attention_heads": heads,
      "num_key_value_heads": 1,
      "lru_width": config.rnn_width,
      "attention_window_size": window,
      "conv1d_width": config.conv_width,
      "logits_soft_cap": config.logits_soft_cap or NO_SOFT_CAP,
      "rms_norm_eps": RMS_NORM_EPS,
      "hidden_activation": "gelu_pytorch_tanh",
      "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA,
                          "partial_rotary_factor": 0.5},
      "block_types": list(config.block_pattern),
      "attention_bias": False,
      "tie_word_embeddings": ties_embeddings(config),
      "use_cache": uses_cache(config),
      # Our documents start with input 0 (the pad id): that is the "beginning" token.
      "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0,
  }
  if gate_blocks_need_remote_code(config):
    values.update(model_type=REMOTE_MODEL_TYPE, architectures=["GriffinForCausalLM"],
                  num_gate_blocks=config.gate_blocks,
                  auto_map={"AutoConfig": "configuration_griffin.GriffinConfig",
                            "AutoModelForCausalLM": "modeling_griffin.GriffinForCausalLM"})
  return values


def config_from_hf(values: Mapping[str, Any], **overrides: Any) -> ModelConfig:
  """The ModelConfig of a transformers RecurrentGemma `config.json` (ours or Google's)."""
  def need(name):
    if name not in values:
      raise ValueError(f"config.json has no {name!r}")
    return values[name]

  if values.get("model_type") not in ("recurrent_gemma", REMOTE_MODEL_TYPE):
    raise ValueError(f"config.json has model_type {values.get('model_type')!r}; expected "
                     f"'recurrent_gemma' (transformers' RecurrentGemmaForCausalLM)")
  if values.get("num_key_value_heads", 1) != 1:
    raise ValueError(f"config.json has num_key_value_heads={values['num_key_value_heads']};"
                     " our attention is multi-query (1 key/value head)")
  if values.get("attention_bias"):
    raise ValueError("config.json has attention_bias=true; our q/k/v projections have no "
                     "bias")
  rope = values.get("rope_parameters") or {}
  theta = rope.get("rope_theta", values.get("rope_theta", ROPE_THETA))
  if float(theta) != ROPE_THETA:
    raise ValueError(f"config.json has rope_theta={theta}; our RoPE uses {ROPE_THETA:g}")
  width, heads = int(need("hidden_size")), int(need("num_attention_heads"))
  pattern = rg.repeating_unit(list(need("block_types")))
  window = int(need("attention_window_size"))
  cap = float(values.get("logits_soft_cap") or 0)
  mlp = int(need("intermediate_size")) // 2
  if mlp % width:
    raise ValueError(f"config.json intermediate_size/2 = {mlp} is not a multiple of "
                     f"hidden_size {width}")
  fields = dict(
      vocab_size=int(need("vocab_size")), width=width,
      rnn_width=int(values.get("lru_width") or width), depth=int(need("num_hidden_layers")),
      num_heads=heads, block_pattern=pattern, mlp_expansion=mlp // width,
      conv_width=int(values.get("conv1d_width", 4)),
      attention_window=None if window >= GLOBAL_WINDOW else window - 1,
      logits_soft_cap=None if cap == 0 or cap >= NO_SOFT_CAP else cap,
      embeddings_scale_by_sqrt_dim=bool(values.get("tie_word_embeddings", True)))
  gate_blocks = values.get("num_gate_blocks")
  if gate_blocks is not None and int(gate_blocks) != heads:
    fields["num_gate_blocks"] = int(gate_blocks)
  if BlockType.ATTENTION.value not in pattern and width % heads:
    # Hawk: the heads only name the gate blocks; keep the width divisible.
    fields.update(num_heads=1, num_gate_blocks=heads)
  fields.update(overrides)
  return ModelConfig(**fields)


def _layer_leaves(block_type: str) -> list[tuple[tuple[str, ...], str, bool]]:
  """(RecurrentGemma path inside blocks.{l}, transformers name, transpose) per leaf."""
  leaves = [(("temporal_pre_norm", "scale"), "temporal_pre_norm.weight", False),
            (("channel_pre_norm", "scale"), "channel_pre_norm.weight", False),
            (("mlp_block", "ffw_down", "kernel"), "mlp_block.down_proj.weight", True),
            (("mlp_block", "ffw_down", "bias"), "mlp_block.down_proj.bias", False)]
  return leaves + block_registry.get(block_type).hf_export.leaves()


def ours_to_hf(params: Mapping[str, Any], config: ModelConfig) -> dict[str, np.ndarray]:
  """The transformers state dict (name -> float32 numpy array) of our parameters.

  Transposed weights are views of `params` (no copy): writers make each contiguous in
  turn (`pretrain.interchange.safetensors_writer`), so an export holds the model about once.
  """
  check_exportable(config)
  tree = rg.ours_to_recurrentgemma(params, config)
  state: dict[str, np.ndarray] = {}
  embedding = np.asarray(tree["embedder"]["input_embedding"], np.float32)
  if ties_embeddings(config):
    state["model.embed_tokens.weight"] = embedding
  else:
    state["lm_head.weight"] = _times(embedding, parametrization.logit_multiplier(config))
    input_scale = (embedding_scale(parametrization.input_scale_width(config))
                   if config.embeddings_scale_by_sqrt_dim else None)
    state["model.embed_tokens.weight"] = (_times(embedding, input_scale)
                                          / np.float32(embedding_scale(config.width)))
  query = parametrization.query_multiplier(config)
  state["model.final_norm.weight"] = np.asarray(tree["final_norm"]["scale"])
  for layer, block_type in enumerate(config.block_types):
    block = tree[f"blocks.{layer}"]
    prefix = f"model.layers.{layer}."
    for path, name, transpose in _layer_leaves(block_type):
      value = np.asarray(rg.get_path(block, path, "our tree"))
      state[prefix + name] = value.T if transpose else value
    up_w, up_b = block["mlp_block"]["ffw_up"]["w"], block["mlp_block"]["ffw_up"]["b"]
    for i, name in enumerate(("gate_proj", "up_proj")):
      state[prefix + f"mlp_block.{name}.weight"] = np.asarray(up_w[i]).T
      state[prefix + f"mlp_block.{name}.bias"] = np.asarray(up_b[i, 0, 0])
    for name, value in block_registry.get(block_type).hf_export.to_hf(block).items():
      state[prefix + name] = value
    if query is not None and block_type == BlockType.ATTENTION.value:
      name = prefix + "temporal_block.q_proj.weight"
      state[name] = _times(state[name], query)
  return state


def _times(table: np.ndarray, multiplier: Optional[float]) -> np.ndarray:
  """`table` times a float32 `multiplier`; `table` itself (no copy) when there is none."""
  return table if multiplier is None else table * np.float32(multiplier)


def hf_to_ours(state: Mapping[str, np.ndarray], config: ModelConfig) -> dict:
  """Our parameter tree (numpy) from a transformers state dict of `config`'s shape."""
  def take(name):
    if name not in state:
      raise ValueError(f"the checkpoint has no tensor {name!r}")
    return np.asarray(state[name])

  tree: dict = {"final_norm": {"scale": take("model.final_norm.weight")}}
  embed = take("model.embed_tokens.weight")
  if config.embeddings_scale_by_sqrt_dim:
    tree["embedder"] = {"input_embedding": embed}
  else:
    table = take("lm_head.weight")
    scaled = embed.astype(np.float32) * np.float32(embedding_scale(config.width))
    if not np.allclose(scaled, table.astype(np.float32), rtol=1e-2, atol=1e-6):
      raise ValueError("the checkpoint's input embedding (times the bfloat16 sqrt(hidden_size)"
                       " it is scaled by) differs from lm_head: our models tie the input "
                       "and output embeddings")
    tree["embedder"] = {"input_embedding": table}
  for layer, block_type in enumerate(config.block_types):
    prefix = f"model.layers.{layer}."
    block: dict = {}
    for path, name, transpose in _layer_leaves(block_type):
      value = take(prefix + name)
      rg.set_path(block, path, value.T if transpose else value)
    gate, up = (take(prefix + f"mlp_block.{n}.weight").T for n in ("gate_proj", "up_proj"))
    biases = [take(prefix + f"mlp_block.{n}.bias") for n in ("gate_proj", "up_proj")]
    rg.set_path(block, ("mlp_block", "ffw_up", "w"), np.stack([gate, up]))
    rg.set_path(block, ("mlp_block", "ffw_up", "b"), np.stack(biases)[:, None, None, :])
    mapped = block_registry.get(block_type).hf_export.from_hf(lambda n, p=prefix: take(p + n))
    for path, value in mapped.items():
      rg.set_path(block, path, value)
    tree[f"blocks.{layer}"] = block
  return rg.recurrentgemma_to_ours(tree, config)

