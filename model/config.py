"""The one description of a model's shape, shared by every layer, the trainer and the tools.

A `ModelConfig` is a frozen dataclass configured through Gin (`ModelConfig.width = 512`)
and validated on construction, so a bad preset fails before anything is compiled, with
a `ValueError` naming the field and the constraint it breaks.

Checkpoints record a config as the JSON of `model_config_to_dict` and read it back with
`model_config_from_dict`.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping, Optional, Sequence

from model import block_registry
from model.attention_options import AttentionOptions
from model.scan.engine import ScanOptions
from model.scan.options import kernel_target


class BlockType(str, enum.Enum):
  """The built-in temporal-mixing block types (`model.blocks`). A block pattern may name
  any type registered with `model.block_registry`, these and others."""
  RECURRENT = "recurrent"   # Conv1D + RG-LRU (Hawk, Griffin)
  ATTENTION = "attention"   # MQA; local when `attention_window` is set, else global
  GATELOOP = "gateloop"     # GateLoop data-controlled complex recurrence


REMAT_POLICIES = ("none", "full", "save_matmuls")
SCAN_IMPLS = ("auto", "lax", "associative", "pallas")
DTYPES = ("float32", "bfloat16", "float16")
LRU_VARIANTS = ("real", "complex")
PARAMETRIZATIONS = ("standard", "mup")
# `depth_scan_unroll=None` unrolls models up to this many layers (griffin_100m's 12).
AUTO_UNROLL_MAX_DEPTH = 12


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a Griffin-family language model.

  Attributes:
    vocab_size: number of token ids (embedding rows, logits width).
    width: residual stream width D.
    rnn_width: recurrence width D_RNN of recurrent blocks.
    num_heads: query heads of MQA, and the number of blocks of the RG-LRU's
      block-diagonal gates unless `num_gate_blocks` is set.
    depth: number of residual blocks.
    block_pattern: temporal block types (names registered with `model.block_registry`),
      repeated cyclically over depth.
    attention_window: local-attention window (keys t-window..t); None = global.
    mlp_expansion: MLP inner width = mlp_expansion * width.
    conv_width: temporal width of the causal depthwise Conv1D.
    num_gate_blocks: blocks of the RG-LRU gates; None = num_heads.
    lru_variant: "real" RG-LRU or "complex" CG-LRU (Griffin appendix B).
    gateloop_head_dim: GateLoop state size per head (1 = max-headed).
    gateloop_fixed_transitions: GateLoop ablation with input-independent transitions.
    logits_soft_cap: c in logits = c * tanh(logits / c); None disables.
    embeddings_scale_by_sqrt_dim: multiply embeddings by sqrt(D) (RecurrentGemma).
    dtype: compute dtype; parameters are always float32 masters.
    parametrization: "standard" (the reference implementation's initialisation and
      one learning rate for every parameter) or "mup", the maximal update
      parametrisation (`model.parametrization`; docs/model.md, "μP"), under which
      hyper-parameters tuned at `mup_base_width` hold at any width. It changes what
      the weights mean, so checkpoints record it and a resume may not change it.
    mup_base_width: under "mup", the width of the proxy model the hyper-parameters
      were tuned at; it must divide `width` (the proxy has the same heads and gate
      blocks, every other width divided by width / mup_base_width). None otherwise.
    scan_impl: linear-recurrence engine, see `model.scan.linear_scan`.
    scan: the scan engines' tunables and target platform (`model.scan.ScanOptions`);
      entry points build them from Gin's `ScanOptions.*` bindings
      (`pretrain.gin_config.build_model_config`). They depend on the machine, not on
      the trained model, so checkpoint metadata leaves them out.
    attention: which implementation computes attention in training calls (XLA's
      masked softmax, or a fused kernel: `model.attention_options.AttentionOptions`);
      like `scan` a property of the machine, built from Gin's `AttentionOptions.*`
      bindings and left out of checkpoint metadata.
    remat: rematerialisation policy of each scanned unit of `block_pattern` (depth is
      always scanned, see `model.lm`).
    depth_scan_unroll: repeating units per iteration of the depth scan. 1 keeps the
      program size and compile time independent of depth (right for deep models);
      unrolling trades compile time for step time. None (the default) unrolls the
      whole depth up to AUTO_UNROLL_MAX_DEPTH layers and scans one unit per
      iteration beyond: on the 2-core CPU the scanned depth cost 6% (griffin_100m)
      to 23% (quickstart) of a loss gradient, and at those depths unrolling compiled
      in about the same time (benchmarks/depth_scan.py; benchmarks/RESULTS.md).
      Except on GPU without remat (`remat="none"`, the scan's kernel target "gpu"):
      there None unrolls the whole depth whatever it is, because inside a loop body
      XLA:GPU materialises every residual the backward pass reads (the loop's stacked
      local-attention scores, written by dynamic-update-slice each trip) where the
      unrolled program fuses them away: griffin_1_3b (24 layers) on fsdp:4,tensor:8
      over 32 H100s at 64 x 2048 tokens compiled to 76.05 GiB of activations per GPU
      looped and 30.93 GiB unrolled (the planner, `model.memory`, says 29.90). At
      256 x 2048 tokens Griffin, Hawk and MQA 1.3B and Griffin 7B compiled to 2.1-2.9x
      the plan looped, and those and Hawk and MQA 7B to 0.93-1.07x unrolled (with
      XLA's memory limit lifted: none fits an H100; benchmarks/RESULTS.md, "Against
      XLA:GPU").
      The cost is compile time: 44-188 s of CPU per preset unrolled against 11-45 s
      looped on the 2-core host. With remat the loop keeps only each unit's input and
      XLA:GPU agrees with the planner looped (0.92-1.23), so it stays a loop; CPU and
      TPU are unchanged.
  """
  vocab_size: int = 256
  width: int = 128
  rnn_width: int = 128
  num_heads: int = 2
  depth: int = 3
  block_pattern: Sequence[str] = ("recurrent", "recurrent", "attention")
  attention_window: Optional[int] = 1024
  mlp_expansion: int = 3
  conv_width: int = 4
  num_gate_blocks: Optional[int] = None
  lru_variant: str = "real"
  gateloop_head_dim: int = 1
  gateloop_fixed_transitions: bool = False
  logits_soft_cap: Optional[float] = None
  embeddings_scale_by_sqrt_dim: bool = False
  dtype: str = "float32"
  parametrization: str = "standard"
  mup_base_width: Optional[int] = None
  scan_impl: str = "auto"
  remat: str = "none"
  depth_scan_unroll: Optional[int] = None
  scan: ScanOptions = dataclasses.field(default_factory=ScanOptions)
  attention: AttentionOptions = dataclasses.field(default_factory=AttentionOptions)

  def __post_init__(self):
    object.__setattr__(self, "block_pattern", tuple(str(b) for b in self.block_pattern))
    self.validate()

  # -- validation -------------------------------------------------------------
  def validate(self) -> None:
    """Raises ValueError naming the first field that breaks a constraint."""
    def positive(name):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")

    for name in ("vocab_size", "width", "rnn_width", "num_heads", "depth",
                 "mlp_expansion", "conv_width", "gateloop_head_dim"):
      positive(name)
    if self.depth_scan_unroll is not None:
      positive("depth_scan_unroll")
    if self.width % self.num_heads:
      raise ValueError(
          f"ModelConfig.width={self.width} must be divisible by num_heads={self.num_heads}")
    if self.rnn_width % self.gate_blocks:
      raise ValueError(
          f"ModelConfig.rnn_width={self.rnn_width} must be divisible by the number of "
          f"RG-LRU gate blocks ({self.gate_blocks}; num_gate_blocks or num_heads)")
    if not self.block_pattern:
      raise ValueError("ModelConfig.block_pattern must name at least one block type")
    for block in self.block_pattern:
      if block not in block_registry.names():
        raise ValueError(
            f"ModelConfig.block_pattern has unknown block type {block!r}; "
            f"expected one of {block_registry.names()}")
    if self.attention_window is not None and self.attention_window < 1:
      raise ValueError(
          f"ModelConfig.attention_window must be >= 1 or None (global), "
          f"got {self.attention_window}")
    if self.lru_variant not in LRU_VARIANTS:
      raise ValueError(f"ModelConfig.lru_variant must be one of {LRU_VARIANTS}, "
                       f"got {self.lru_variant!r}")
    if self.lru_variant == "complex" and self.rnn_width % (2 * self.gate_blocks):
      raise ValueError(
          f"ModelConfig.rnn_width={self.rnn_width} must be divisible by 2 x gate blocks "
          f"({2 * self.gate_blocks}) for the complex CG-LRU: its channels are real and "
          "imaginary halves, and each half is split into the gates' blocks")
    for block in dict.fromkeys(self.block_pattern):   # each type's own constraints
      block_registry.get(block).validate(self)
    self._validate_parametrization()
    if self.dtype not in DTYPES:
      raise ValueError(f"ModelConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
    if self.scan_impl not in SCAN_IMPLS:
      raise ValueError(f"ModelConfig.scan_impl must be one of {SCAN_IMPLS}, "
                       f"got {self.scan_impl!r}")
    if not isinstance(self.scan, ScanOptions):
      raise ValueError(f"ModelConfig.scan must be a ScanOptions, got {self.scan!r}")
    if not isinstance(self.attention, AttentionOptions):
      raise ValueError(f"ModelConfig.attention must be an AttentionOptions, "
                       f"got {self.attention!r}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"ModelConfig.remat must be one of {REMAT_POLICIES}, "
                       f"got {self.remat!r}")
    if self.logits_soft_cap is not None and self.logits_soft_cap <= 0:
      raise ValueError(f"ModelConfig.logits_soft_cap must be > 0 or None, "
                       f"got {self.logits_soft_cap}")

  def _validate_parametrization(self) -> None:
    if self.parametrization not in PARAMETRIZATIONS:
      raise ValueError(f"ModelConfig.parametrization must be one of {PARAMETRIZATIONS}, "
                       f"got {self.parametrization!r}")
    if self.parametrization == "standard":
      if self.mup_base_width is not None:
        raise ValueError(f"ModelConfig.mup_base_width={self.mup_base_width} is set but "
                         "parametrization is 'standard'; set parametrization = 'mup' or "
                         "remove it")
      return
    base = self.mup_base_width
    if not isinstance(base, int) or base < 1:
      raise ValueError("ModelConfig.parametrization='mup' needs mup_base_width, the width "
                       f"the hyper-parameters were tuned at (a positive integer), got {base!r}")
    if self.width % base:
      raise ValueError(f"ModelConfig.mup_base_width={base} must divide width={self.width}: "
                       "the tuned proxy is this model with every width divided by "
                       "width / mup_base_width")
    for block in dict.fromkeys(self.block_pattern):
      if block_registry.get(block).param_roles is None:
        raise ValueError(f"ModelConfig.parametrization='mup': block type {block!r} declares "
                         "no parameter roles (param_roles in its registry entry), so μP "
                         "cannot scale its parameters")

  # -- derived sizes ----------------------------------------------------------
  @property
  def head_dim(self) -> int:
    return self.width // self.num_heads

  @property
  def gate_blocks(self) -> int:
    return self.num_gate_blocks or self.num_heads

  @property
  def mlp_width(self) -> int:
    return self.mlp_expansion * self.width

  @property
  def block_types(self) -> tuple[str, ...]:
    """The temporal block type of every residual block, in order."""
    pattern = self.block_pattern
    return tuple(pattern[i % len(pattern)] for i in range(self.depth))

  @property
  def num_scanned_units(self) -> int:
    """Full repetitions of the block pattern (scanned over depth)."""
    return self.depth // len(self.block_pattern)

  @property
  def depth_unroll(self) -> int:
    """Units per iteration of the depth scan, with `depth_scan_unroll=None` resolved
    (see `depth_scan_unroll` for the rule and its evidence)."""
    units = max(self.num_scanned_units, 1)
    if self.depth_scan_unroll is not None:
      return min(self.depth_scan_unroll, units)
    if self.depth <= AUTO_UNROLL_MAX_DEPTH or self._unrolls_whole_depth_on_gpu():
      return units
    return 1

  def _unrolls_whole_depth_on_gpu(self) -> bool:
    """Whether the default unrolls any depth: on GPU without remat, where a looped
    depth makes XLA:GPU keep the stacked residuals of every unit (2.1-2.9x the plan)."""
    return self.remat == "none" and kernel_target(self.scan) == "gpu"

  @property
  def remainder_block_types(self) -> tuple[str, ...]:
    """Blocks of the trailing partial unit, applied after the scanned units."""
    return self.block_pattern[: self.depth % len(self.block_pattern)]

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)


# Fields that describe the machine a run executes on rather than the trained model.
_MACHINE_FIELDS = ("scan", "attention")
# Fields recorded only when they differ from their default, so that a standard model's
# metadata stays what earlier versions wrote and read.
_RECORDED_IF_SET = {"parametrization": "standard", "mup_base_width": None}


def model_config_to_dict(config: ModelConfig) -> dict[str, Any]:
  """The JSON-ready form of `config` that checkpoints record.

  Leaves out `scan` and `attention`: a checkpoint written on a TPU must load on a CPU,
  where the TPU's kernel options would not apply. The parametrisation is recorded only
  when it is μP (a standard model's dict is what it was before μP existed).
  """
  values = {f.name: getattr(config, f.name) for f in dataclasses.fields(ModelConfig)
            if f.name not in _MACHINE_FIELDS
            and not (f.name in _RECORDED_IF_SET
                     and getattr(config, f.name) == _RECORDED_IF_SET[f.name])}
  values["block_pattern"] = list(config.block_pattern)
  return values


def model_config_from_dict(values: Mapping[str, Any]) -> ModelConfig:
  """The ModelConfig of a `model_config_to_dict` dict, old or new.

  A `scan` entry (written by earlier versions) is ignored and the config gets the
  default options: the loader supplies its own machine's (`config.replace(scan=...)`,
  and likewise `attention`).

  Raises:
    ValueError: `values` has fields ModelConfig does not know (named), or a field
      breaks a constraint.
  """
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(values) - known)
  if unknown:
    raise ValueError(f"ModelConfig has no fields {unknown}; the config was written by "
                     "another version of this code")
  return ModelConfig(**{k: v for k, v in values.items() if k not in _MACHINE_FIELDS})


def recorded_parametrization(values: Mapping[str, Any]) -> str:
  """The parametrisation a `model_config_to_dict` dict records, as `describe_parametrization`
  writes it (read without building the config, which may fail for other reasons)."""
  return describe_parametrization(values.get("parametrization", "standard"),
                                  values.get("mup_base_width"))


def describe_parametrization(kind: str, base_width: Optional[int]) -> str:
  """'standard' or 'mup (base width W)'."""
  return kind if kind == "standard" else f"{kind} (base width {base_width})"
