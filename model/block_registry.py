"""The temporal-block registry: the one place the framework learns what a block type is.

A residual block's temporal mixer is named by a string in `ModelConfig.block_pattern`
("recurrent", "attention", "gateloop", ...). Everything that depends on the type asks
this registry for the type's `BlockSpec` instead of switching on the name: config
validation (`model.config`), the layer and its decoding cache (`model.residual_block`),
parameter and FLOP counts (`model.counting`), the memory planner's activation terms
(`model.memory`), the sweep's model families (`launch.sweeps.sweep_design`) and the transformers
export (`model.hf_params`). So a new block type is one module that defines a spec and
calls `register`, and nothing else changes; a name nobody registered is a `ValueError`
wherever it is first looked up, never a silent zero.

The built-in blocks register themselves in `model.blocks`, which `model/__init__.py`
imports, so they are known before any `ModelConfig` is built. This module imports
nothing from the model, so every model module may import it.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import numpy as np

from sharding import rules as rules_lib

# The terms of `model.counting.FlopsBreakdown` a block's sequence-mixing work may add to.
FLOP_TERMS = ("attention", "recurrence")
# (path inside the RecurrentGemma layer sub-tree, transformers name, transpose?) of one leaf.
HFLeaf = tuple[tuple[str, ...], str, bool]


class HFExport(Protocol):
  """How one block type's parameters map onto transformers' RecurrentGemma layer
  (`model.hf_params`; docs/interchange.md)."""

  def check(self, config: Any) -> None:
    """Raises ValueError when this configuration of the block has no counterpart."""

  def leaves(self) -> list[HFLeaf]:
    """The temporal block's leaves that map one to one (transposed or not)."""

  def to_hf(self, layer: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Tensors that need more than a transpose, from one RecurrentGemma layer sub-tree;
    names relative to `model.layers.{l}.`."""

  def from_hf(self, take: Callable[[str], np.ndarray], layer: dict) -> None:
    """The inverse of `to_hf`: fills `layer` from `take(name)` (same relative names)."""


class BlockSpec(Protocol):
  """Everything the framework needs to know about one temporal-mixing block type.

  Attributes:
    name: the `ModelConfig.block_pattern` entry; also the Flax module's name in the
      parameter tree.
    title: how messages name it ("GateLoop", "MQA attention").
    layer: the Flax module class: `layer(config, name=...)(x [B, T, D], segment_pos
      [B, T], cache=None, return_cache=False) -> (y [B, T, D], cache or None)`.
    family: the `launch.sweeps.sweep_design` family made of this block alone (None: none).
    logical_axes: the logical axis names its parameters and activations use; each needs
      a rule in `sharding.rules.DEFAULT_RULES`, which decides their layout (checked by
      `register`).
    hf_export: the mapping onto transformers' RecurrentGemma layer; None when
      transformers has no such block.
  """
  name: str
  title: str
  layer: type
  family: Optional[str]
  logical_axes: tuple[str, ...]
  hf_export: Optional[HFExport]

  def validate(self, config: Any) -> None:
    """Raises ValueError naming the `ModelConfig` field this block cannot work with."""

  def init_cache(self, config: Any, batch_size: int, dtype: Any,
                 max_length: Optional[int]) -> Any:
    """The empty decoding cache of one such block (a pytree of arrays)."""

  def matmul_params(self, config: Any) -> int:
    """Weights that multiply each token once (the "6N" of the FLOP count)."""

  def vector_params(self, config: Any) -> int:
    """Every other parameter of the block: biases, per-channel parameters."""

  def mixing_flops(self, config: Any, seq_len: int) -> Mapping[str, float]:
    """Training FLOPs per token of one block beyond its weights' 6N, by
    `FLOP_TERMS` term (attention scores, element-wise recurrence work)."""

  def kept_activations(self, config: Any, seq: int, tensor: int
                       ) -> tuple[float, float, float]:
    """What the block keeps for its backward pass per token on one device, beyond the
    residual block's norms and MLP: (compute-dtype elements, float32 elements, of which
    float32 attention scores), with `tensor` shards of the tensor-parallel widths."""

  def saved_matmul_outputs(self, config: Any, seq: int, tensor: int
                           ) -> tuple[float, float]:
    """What remat "save_matmuls" keeps of the block per token: its matmul outputs in
    the compute dtype, and float32 attention scores."""


_SPECS: dict[str, BlockSpec] = {}
# family -> block pattern of the registered blocks' single-block families.
FAMILIES: dict[str, tuple[str, ...]] = {}


def register(spec: BlockSpec) -> BlockSpec:
  """Adds `spec` under `spec.name`; returns it, so a module can keep it as a constant.

  Raises:
    ValueError: the name or family is taken by another spec, or a logical axis has no
      sharding rule (it would otherwise fail only once a mesh is in scope).
  """
  taken = _SPECS.get(spec.name)
  if taken is not None and taken is not spec:
    raise ValueError(f"block type {spec.name!r} is registered already ({taken.title})")
  if spec.family is not None and FAMILIES.get(spec.family, (spec.name,)) != (spec.name,):
    raise ValueError(f"sweep family {spec.family!r} is taken by blocks "
                     f"{FAMILIES[spec.family]}")
  unruled = sorted(set(spec.logical_axes) - set(rules_lib.rules_dict()))
  if unruled:
    raise ValueError(f"block type {spec.name!r} uses logical axes {unruled} that have no "
                     "rule in sharding.rules.DEFAULT_RULES; add one there")
  _SPECS[spec.name] = spec
  if spec.family is not None:
    FAMILIES[spec.family] = (spec.name,)
  return spec


def unregister(name: str) -> None:
  """Removes a block type (for tests that register a block of their own)."""
  spec = _SPECS.pop(name)
  if spec.family is not None:
    del FAMILIES[spec.family]


def names() -> list[str]:
  """The registered block types, sorted."""
  return sorted(_SPECS)


def get(name: str) -> BlockSpec:
  """The spec of block type `name`.

  Raises:
    ValueError: `name` is not registered (the message lists the types that are).
  """
  spec = _SPECS.get(name)
  if spec is None:
    raise ValueError(f"unknown block type {name!r}; expected one of {names()}")
  return spec


def count_by_type(block_types: Sequence[str]) -> dict[str, int]:
  """{block type: how many of `block_types` have it}, in order of first appearance."""
  return dict(collections.Counter(block_types))
