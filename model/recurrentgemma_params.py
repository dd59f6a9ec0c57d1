"""RecurrentGemma parameter trees <-> ours, and the ModelConfig a RecurrentGemma tree implies.

RecurrentGemma (`recurrentgemma.jax.Griffin`) keeps one sub-tree per layer,
`blocks.{l}`, while our `model.lm.LanguageModel` scans the repeating unit of the block
pattern over depth: layer l = u·P + j of a pattern of length P lives at
`blocks/block_{j}` index [u] (a leading `layers` axis) for the
`config.num_scanned_units` full units, and at `remainder_{j}` (no leading axis) for the
trailing partial unit. Converting therefore stacks (theirs -> ours) or slices (ours ->
theirs) per pattern position, and renames leaves:

    theirs (blocks.{l}/...)                      ours (.../block_{j} or remainder_{j}/...)
    embedder/input_embedding                     embedder/embedding
    final_norm/scale                             final_norm/scale
    temporal_pre_norm/scale                      temporal_norm/scale
    channel_pre_norm/scale                       mlp_norm/scale
    mlp_block/ffw_up/w[0], w[1]     [2, D, M]    mlp/gate/kernel, mlp/up/kernel  [D, M]
    mlp_block/ffw_up/b[0,0,0], b[1,0,0]          mlp/gate/bias, mlp/up/bias      [M]
    mlp_block/ffw_down/{kernel,bias}             mlp/down/{kernel,bias}
    recurrent_block/linear_{x,y,out}/{kernel,bias}  recurrent/linear_{x,y,out}/{kernel,bias}
    recurrent_block/conv_1d/{w,b}                recurrent/conv1d/{kernel,bias}  (same tap order)
    recurrent_block/rg_lru/a_param               recurrent/rg_lru/a_param
    recurrent_block/rg_lru/{input,a}_gate/{w,b}  recurrent/rg_lru/{input,a}_gate/{kernel,bias}
    attention_block/proj_{q,k,v}/kernel          attention/{q,k,v}/kernel
    attention_block/proj_final/{kernel,bias}     attention/out/{kernel,bias}

Values are never transformed (the maths of the two models is the same, see docs/model.md),
only regrouped. Everything here runs on the host with numpy, so a 9B checkpoint is
converted without touching accelerator memory; call it outside `jax.jit`.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

from model.config import BlockType, ModelConfig

# (our path inside a residual block, their path inside `blocks.{l}`), per block type.
_SHARED_LEAVES = (
    (("temporal_norm", "scale"), ("temporal_pre_norm", "scale")),
    (("mlp_norm", "scale"), ("channel_pre_norm", "scale")),
    (("mlp", "down", "kernel"), ("mlp_block", "ffw_down", "kernel")),
    (("mlp", "down", "bias"), ("mlp_block", "ffw_down", "bias")),
)
_TEMPORAL_LEAVES = {
    BlockType.RECURRENT.value: tuple(
        (("recurrent",) + ours, ("recurrent_block",) + theirs) for ours, theirs in (
            (("linear_x", "kernel"), ("linear_x", "kernel")),
            (("linear_x", "bias"), ("linear_x", "bias")),
            (("linear_y", "kernel"), ("linear_y", "kernel")),
            (("linear_y", "bias"), ("linear_y", "bias")),
            (("linear_out", "kernel"), ("linear_out", "kernel")),
            (("linear_out", "bias"), ("linear_out", "bias")),
            (("conv1d", "kernel"), ("conv_1d", "w")),
            (("conv1d", "bias"), ("conv_1d", "b")),
            (("rg_lru", "a_param"), ("rg_lru", "a_param")),
            (("rg_lru", "input_gate", "kernel"), ("rg_lru", "input_gate", "w")),
            (("rg_lru", "input_gate", "bias"), ("rg_lru", "input_gate", "b")),
            (("rg_lru", "a_gate", "kernel"), ("rg_lru", "a_gate", "w")),
            (("rg_lru", "a_gate", "bias"), ("rg_lru", "a_gate", "b")),
        )),
    BlockType.ATTENTION.value: tuple(
        (("attention",) + ours, ("attention_block",) + theirs) for ours, theirs in (
            (("q", "kernel"), ("proj_q", "kernel")),
            (("k", "kernel"), ("proj_k", "kernel")),
            (("v", "kernel"), ("proj_v", "kernel")),
            (("out", "kernel"), ("proj_final", "kernel")),
            (("out", "bias"), ("proj_final", "bias")),
        )),
}
_THEIR_TEMPORAL_NAME = {BlockType.RECURRENT.value: "recurrent_block",
                        BlockType.ATTENTION.value: "attention_block"}


def _unwrap(tree: Mapping[str, Any]) -> Mapping[str, Any]:
  """Accepts either the parameters or a `{"params": ...}` variables dict."""
  return tree["params"] if "params" in tree else tree


def get_path(tree: Mapping[str, Any], path: Sequence[str], where: str) -> Any:
  """The leaf at `path`; a ValueError names the first missing key (`where` says whose tree)."""
  node = tree
  for i, key in enumerate(path):
    if not isinstance(node, Mapping) or key not in node:
      raise ValueError(f"{where}: parameter {'/'.join(path)!r} is missing (no "
                       f"{key!r} under {'/'.join(path[:i]) or 'the root'})")
    node = node[key]
  return node


def set_path(tree: dict, path: Sequence[str], value: Any) -> None:
  """Puts `value` at `path`, creating the dicts on the way."""
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _block_types(params: Mapping[str, Any]) -> list[str]:
  """Temporal block type of every `blocks.{l}` of a RecurrentGemma tree, in order."""
  types = []
  while f"blocks.{len(types)}" in params:
    block = params[f"blocks.{len(types)}"]
    found = [t for t, name in _THEIR_TEMPORAL_NAME.items() if name in block]
    if len(found) != 1:
      raise ValueError(f"RecurrentGemma blocks.{len(types)} holds {sorted(block)}; expected "
                       "exactly one of 'recurrent_block' or 'attention_block'")
    types.append(found[0])
  if not types:
    raise ValueError("not a RecurrentGemma parameter tree: no 'blocks.0' (keys: "
                     f"{sorted(params)})")
  extra = [k for k in params if k.startswith("blocks.") and
           not (k[7:].isdigit() and int(k[7:]) < len(types))]
  if extra:
    raise ValueError(f"RecurrentGemma layers are not numbered 0..{len(types) - 1}: {extra}")
  return types


def repeating_unit(block_types: Sequence[str]) -> tuple[str, ...]:
  """The shortest pattern whose cyclic repetition gives `block_types`."""
  for period in range(1, len(block_types)):
    if all(block_types[i] == block_types[i % period] for i in range(len(block_types))):
      return tuple(block_types[:period])
  return tuple(block_types)


def config_from_recurrentgemma_params(
    params: Mapping[str, Any], *, window: Optional[int], logits_soft_cap: Optional[float],
    embeddings_scale_by_sqrt_dim: bool, **overrides: Any) -> ModelConfig:
  """The ModelConfig of a RecurrentGemma tree (parameters or `{"params": ...}`).

  Widths, heads, gate blocks, depth, Conv1D width, MLP expansion and the block pattern
  (the shortest repeating unit of the layers' types) are read from the shapes; what
  shapes cannot tell is passed in. Leaves may be arrays or `jax.ShapeDtypeStruct`s.

  Args:
    params: the RecurrentGemma tree.
    window: local attention window (RecurrentGemma: 2048); None for global attention.
    logits_soft_cap: soft cap c (RecurrentGemma: 30.0); None or 0 disables it.
    embeddings_scale_by_sqrt_dim: whether embeddings are scaled by √D (RecurrentGemma:
      True).
    **overrides: any other ModelConfig field (e.g. dtype, remat, scan_impl).
  """
  params = _unwrap(params)
  types = _block_types(params)
  vocab_size, width = get_path(params, ("embedder", "input_embedding"), "RecurrentGemma").shape
  ffw_up = get_path(params, ("blocks.0", "mlp_block", "ffw_up", "w"), "RecurrentGemma").shape
  if ffw_up[2] % width:
    raise ValueError(f"RecurrentGemma MLP width {ffw_up[2]} is not a multiple of the model "
                     f"width {width}; ModelConfig.mlp_expansion must be an integer")
  fields = dict(vocab_size=int(vocab_size), width=int(width), depth=len(types),
                mlp_expansion=int(ffw_up[2] // width),
                block_pattern=repeating_unit(types), attention_window=window,
                logits_soft_cap=logits_soft_cap or None,
                embeddings_scale_by_sqrt_dim=bool(embeddings_scale_by_sqrt_dim))
  gate_blocks = num_heads = None
  if BlockType.RECURRENT.value in types:
    l = types.index(BlockType.RECURRENT.value)
    block = f"blocks.{l}"
    gate_blocks, block_width, _ = get_path(
        params, (block, "recurrent_block", "rg_lru", "a_gate", "w"), "RecurrentGemma").shape
    conv = get_path(params, (block, "recurrent_block", "conv_1d", "w"), "RecurrentGemma").shape
    fields.update(rnn_width=int(gate_blocks * block_width), conv_width=int(conv[0]))
  if BlockType.ATTENTION.value in types:
    l = types.index(BlockType.ATTENTION.value)
    head_dim = get_path(params, (f"blocks.{l}", "attention_block", "proj_k", "kernel"),
                    "RecurrentGemma").shape[1]
    num_heads = int(width // head_dim)
  # RecurrentGemma uses one gate block per head; a Hawk tree only shows the gate blocks.
  fields["num_heads"] = num_heads or int(gate_blocks)
  if gate_blocks is not None and gate_blocks != fields["num_heads"]:
    fields["num_gate_blocks"] = int(gate_blocks)
  fields.update(overrides)
  return ModelConfig(**fields)


def _check_depth(config: ModelConfig, types: Sequence[str]) -> None:
  if tuple(types) != config.block_types:
    raise ValueError(f"the RecurrentGemma tree's layer types {tuple(types)} differ from "
                     f"ModelConfig.block_types {config.block_types}; build the config with "
                     "config_from_recurrentgemma_params")


def _layer_locations(config: ModelConfig):
  """(layer l, pattern position j, scanned unit u or None for the remainder)."""
  period = len(config.block_pattern)
  for l in range(config.depth):
    u, j = divmod(l, period)
    yield l, j, (u if u < config.num_scanned_units else None)


def _their_leaves(block_type: str):
  """(our path, their path, how) for every leaf of a residual block; how: None | index."""
  leaves = [(ours, theirs, None) for ours, theirs in _SHARED_LEAVES]
  leaves += [(("mlp", "gate", "kernel"), ("mlp_block", "ffw_up", "w"), (0,)),
             (("mlp", "up", "kernel"), ("mlp_block", "ffw_up", "w"), (1,)),
             (("mlp", "gate", "bias"), ("mlp_block", "ffw_up", "b"), (0, 0, 0)),
             (("mlp", "up", "bias"), ("mlp_block", "ffw_up", "b"), (1, 0, 0))]
  leaves += [(ours, theirs, None) for ours, theirs in _TEMPORAL_LEAVES[block_type]]
  return leaves


def recurrentgemma_to_ours(params: Mapping[str, Any], config: ModelConfig) -> dict:
  """Our parameter tree (numpy) holding the weights of a RecurrentGemma tree."""
  theirs = _unwrap(params)
  _check_depth(config, _block_types(theirs))
  ours: dict = {}
  set_path(ours, ("embedder", "embedding"),
       np.asarray(get_path(theirs, ("embedder", "input_embedding"), "RecurrentGemma")))
  set_path(ours, ("final_norm", "scale"),
       np.asarray(get_path(theirs, ("final_norm", "scale"), "RecurrentGemma")))
  stacks: dict = {}
  for l, j, u in _layer_locations(config):
    block = f"blocks.{l}"
    for our_path, their_path, index in _their_leaves(config.block_types[l]):
      value = np.asarray(get_path(theirs, (block,) + their_path, "RecurrentGemma"))
      if index is not None:
        value = value[index]
      if u is None:
        set_path(ours, (f"remainder_{j}",) + our_path, value)
      else:
        stacks.setdefault((f"block_{j}",) + our_path, []).append(value)
  for path, values in stacks.items():
    set_path(ours, ("blocks",) + path, np.stack(values))
  return ours


def ours_to_recurrentgemma(params: Mapping[str, Any], config: ModelConfig) -> dict:
  """The RecurrentGemma tree (numpy, without the "params" wrapper) of our parameters."""
  theirs: dict = {}
  set_path(theirs, ("embedder", "input_embedding"),
       np.asarray(get_path(params, ("embedder", "embedding"), "our tree")))
  set_path(theirs, ("final_norm", "scale"),
       np.asarray(get_path(params, ("final_norm", "scale"), "our tree")))
  for l, j, u in _layer_locations(config):
    block = f"blocks.{l}"
    mlp_up_w, mlp_up_b = [None, None], [None, None]
    for our_path, their_path, index in _their_leaves(config.block_types[l]):
      if u is None:
        value = np.asarray(get_path(params, (f"remainder_{j}",) + our_path, "our tree"))
      else:
        value = np.asarray(get_path(params, ("blocks", f"block_{j}") + our_path, "our tree"))[u]
      if index is None:
        set_path(theirs, (block,) + their_path, value)
      elif their_path[-1] == "w":
        mlp_up_w[index[0]] = value
      else:
        mlp_up_b[index[0]] = value
    set_path(theirs, (block, "mlp_block", "ffw_up", "w"), np.stack(mlp_up_w))
    set_path(theirs, (block, "mlp_block", "ffw_up", "b"), np.stack(mlp_up_b)[:, None, None, :])
  return theirs
