"""The temporal-block registry: the one place the framework learns what a block type is.

A residual block's temporal mixer is named by a string in `ModelConfig.block_pattern`
("recurrent", "attention", "gateloop", ...). Everything that depends on the type asks
this registry for the type's `Block` instead of switching on the name: config
validation (`model.config`), the layer and its decoding cache (`model.residual_block`),
parameter and FLOP counts (`model.counting`), the memory planner's activation terms
(`model.memory`), the sweep's model families (`launch.sweeps.sweep_design`) and the
transformers export (`model.hf_params`). A name nobody registered is a `ValueError`
wherever it is first looked up, never a silent zero.

What a block must declare is small, so that a research block trains, is planned and is
swept from its layer alone (`BlockSpec`): its `name`, its Flax `layer` and its
`param_count`. Everything else is a declaration it may add, and each has a default:

  title, family          its name; a sweep family of the block alone, named after it
  logical_axes           not checked at registration (the sharding rules name a missing
                         axis when the parameters are laid out)
  validate               accepts every ModelConfig
  init_cache             zeros shaped like the cache its layer returns for one token
                         (`model.residual_block.init_block_cache`)
  counting: BlockCounting   `model.counting`: every parameter counts as a weight that
                         multiplies each token once (6N), no sequence-mixing FLOPs
  memory: BlockMemory    `model.memory`: kept activations estimated from the widths of
                         its weights, and the plan names the block as estimated
  hf_export: HFExport    `model.hf_params`: export refused with one line naming it
  param_roles            `model.parametrization`: {parameter path inside the block:
                         ParamRole}; without it the block trains under the standard
                         parametrisation only (μP is refused in one line naming it)

The capabilities (counting, memory, hf_export) are protocols defined here, below the
tools that read them, so a block's own package (`model/blocks/<name>/`) implements them
without importing the planner or the interchange code. The built-in blocks register
themselves in `model.blocks`, which `model/__init__.py` imports, so they are known before
any `ModelConfig` is built. This module imports nothing from the model, so every model
module may import it.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import numpy as np

from sharding import rules as rules_lib

# The terms of `model.counting.FlopsBreakdown` a block's sequence-mixing work may add to.
FLOP_TERMS = ("attention", "recurrence")
# (path inside the RecurrentGemma layer sub-tree, transformers name, transpose?) of one leaf.
HFLeaf = tuple[tuple[str, ...], str, bool]


class ParamRole(str, enum.Enum):
  """What a parameter is to μP (`model.parametrization`; docs/model.md, "μP"), which
  fixes how its initialisation, Adam learning rate and forward multiplier scale with
  width. The tied embedding is the one input-like parameter (and, tied, the output-like
  readout); it is the language model's own, so blocks declare hidden and vector roles."""
  INPUT = "input"     # the embedding: init std fixed in width, LR unchanged
  HIDDEN = "hidden"   # a matrix whose fan-in grows with width: init var ∝ 1/fan-in, LR ∝ 1/m
  VECTOR = "vector"   # biases, scales, per-channel parameters (fan-in fixed): LR unchanged


class BlockSpec(Protocol):
  """What every temporal-mixing block type declares (the optional rest: module docstring).

  Attributes:
    name: the `ModelConfig.block_pattern` entry; also the Flax module's name in the
      parameter tree.
    layer: the Flax module class: `layer(config, name=...)(x [B, T, D], segment_pos
      [B, T], cache=None, return_cache=False) -> (y [B, T, D], cache or None)`.
  """
  name: str
  layer: type

  def param_count(self, config: Any) -> int:
    """Parameters of one such block (`count_params == analytic_param_counts` in
    tests/test_counting.py holds the built-ins' counts against the real tree)."""


class BlockCounting(Protocol):
  """How a block's training FLOPs split (`model.counting`; docs/model.md)."""

  def matmul_params(self, config: Any) -> int:
    """Of `param_count`, the weights that multiply each token once (the "6N")."""

  def mixing_flops(self, config: Any, seq_len: int) -> Mapping[str, float]:
    """Training FLOPs per token of one block beyond its weights' 6N, by
    `FLOP_TERMS` term (attention scores, element-wise recurrence work)."""


class BlockMemory(Protocol):
  """A block's per-token activation terms in the analytic planner (`model.memory`),
  calibrated against `pretrain.compilation.memory_plan.plan_memory(method="compiled")`."""

  def kept_activations(self, config: Any, seq: int, tensor: int
                       ) -> tuple[float, float, float]:
    """What the block keeps for its backward pass per token on one device, beyond the
    residual block's norms and MLP: (compute-dtype elements, float32 elements, of which
    float32 attention scores), with `tensor` shards of the tensor-parallel widths."""

  def saved_matmul_outputs(self, config: Any, seq: int, tensor: int
                           ) -> tuple[float, float]:
    """What remat "save_matmuls" keeps of the block per token: its matmul outputs in
    the compute dtype, and float32 attention scores."""


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

  def from_hf(self, take: Callable[[str], np.ndarray]) -> dict[tuple[str, ...], np.ndarray]:
    """The inverse of `to_hf`: {path inside the layer sub-tree: tensor}, read with
    `take(name)` (same relative names)."""


@dataclasses.dataclass(frozen=True)
class Block:
  """A registered block type as the framework reads it: its spec, with every optional
  declaration filled in by its default. A capability the spec leaves out is None here;
  the tool that reads it decides what it does without one (module docstring)."""
  spec: BlockSpec
  title: str
  family: Optional[str]
  logical_axes: tuple[str, ...]
  validate: Callable[[Any], None]
  init_cache: Optional[Callable[..., Any]]
  counting: Optional[BlockCounting]
  memory: Optional[BlockMemory]
  hf_export: Optional[HFExport]
  param_roles: Optional[Mapping[str, ParamRole]]

  @property
  def name(self) -> str:
    return self.spec.name

  @property
  def layer(self) -> type:
    return self.spec.layer

  def param_count(self, config: Any) -> int:
    return int(self.spec.param_count(config))


def _accept(config: Any) -> None:
  del config


def _block(spec: BlockSpec) -> Block:
  missing = [member for member in ("name", "layer", "param_count")
             if not hasattr(spec, member)]
  if missing:
    raise ValueError(f"block spec {type(spec).__name__} lacks {missing}; every block "
                     "declares its name, its layer and its param_count")
  return Block(spec=spec, title=getattr(spec, "title", spec.name),
               family=getattr(spec, "family", spec.name),
               logical_axes=tuple(getattr(spec, "logical_axes", ())),
               validate=getattr(spec, "validate", _accept),
               init_cache=getattr(spec, "init_cache", None),
               counting=getattr(spec, "counting", None),
               memory=getattr(spec, "memory", None),
               hf_export=getattr(spec, "hf_export", None),
               param_roles=_param_roles(spec))


def _param_roles(spec: BlockSpec) -> Optional[dict[str, ParamRole]]:
  """The spec's `param_roles` with each role checked (a typo fails at registration)."""
  roles = getattr(spec, "param_roles", None)
  if roles is None:
    return None
  try:
    return {path: ParamRole(role) for path, role in roles.items()}
  except ValueError as error:
    raise ValueError(f"block type {spec.name!r} declares a parameter role that is not one "
                     f"of {[r.value for r in ParamRole]}: {error}") from None


_BLOCKS: dict[str, Block] = {}
# family -> block pattern of the registered blocks' single-block families.
FAMILIES: dict[str, tuple[str, ...]] = {}


def register(spec: BlockSpec) -> BlockSpec:
  """Adds `spec` under `spec.name`; returns it, so a module can keep it as a constant.

  Raises:
    ValueError: a required member is missing, the name or family is taken by another
      spec, or a declared logical axis has no sharding rule (it would otherwise fail
      only once a mesh is in scope).
  """
  block = _block(spec)
  taken = _BLOCKS.get(block.name)
  if taken is not None and taken.spec is not spec:
    raise ValueError(f"block type {block.name!r} is registered already ({taken.title})")
  if block.family is not None and FAMILIES.get(block.family, (block.name,)) != (block.name,):
    raise ValueError(f"sweep family {block.family!r} is taken by blocks "
                     f"{FAMILIES[block.family]}")
  unruled = sorted(set(block.logical_axes) - set(rules_lib.rules_dict()))
  if unruled:
    raise ValueError(f"block type {block.name!r} uses logical axes {unruled} that have no "
                     "rule in sharding.rules.DEFAULT_RULES; add one there")
  _BLOCKS[block.name] = block
  if block.family is not None:
    FAMILIES[block.family] = (block.name,)
  return spec


def unregister(name: str) -> None:
  """Removes a block type (for tests that register a block of their own)."""
  block = _BLOCKS.pop(name)
  if block.family is not None:
    del FAMILIES[block.family]


def names() -> list[str]:
  """The registered block types, sorted."""
  return sorted(_BLOCKS)


def get(name: str) -> Block:
  """The registered block type `name`.

  Raises:
    ValueError: `name` is not registered (the message lists the types that are).
  """
  block = _BLOCKS.get(name)
  if block is None:
    raise ValueError(f"unknown block type {name!r}; expected one of {names()}")
  return block


def count_by_type(block_types: Sequence[str]) -> dict[str, int]:
  """{block type: how many of `block_types` have it}, in order of first appearance."""
  return dict(collections.Counter(block_types))
