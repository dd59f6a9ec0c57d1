"""Per-device memory of a training step on a mesh, planned before any chip is rented.

The analytic planner: parameters, AdamW moments and gradients are counted exactly from
the model's parameter shapes and the sharding rules (each leaf's per-device shard);
activations at the peak of the backward pass are estimated per token from the block
structure, with buffer counts calibrated against the TPU compiler and held against the
GPU compiler (below). Instant for any size; the 14B preset on 128 devices plans in
seconds. The other method, XLA's own figures for the trainer's compiled step, needs the
trainer's program and so lives above the model, in `pretrain.compilation.memory_plan` (which
`pretrain.summary` uses).

Analytic model of the peak (bytes per device). The total is
    params + optimizer + gradients + max(activations, workspace)
because the AdamW update's temporaries (workspace: 2 x the parameter shard) are allocated
after the backward pass has freed the activations. Activations are per-token parts
times tokens per device, batch·seq / (replica·data·fsdp·sequence), plus the weights of
the units being computed in the compute dtype, split over `tensor` (the FSDP all-gather).
Widths the rules split over `tensor` (M = MLP, R = RNN channels, query heads, V = vocab)
are divided by its size t. What one residual block keeps for its backward pass, per
token, in buffers of that width (c: compute dtype, f: float32):
  residual + MLP      4·D c + 2·M/t c     (block input, mid residual, both norms' outputs;
                                           gate and up projections)
  recurrent           5·R/t c + 2·R/t f   (the two branches' projections, the Conv1D's
                                           output and the two gates' bf16 pre-activations;
                                           the scan kernel's residuals: the decay a and the
                                           state h; the float32 gate chain is recomputed;
                                           a scan lowered off TPU: 3·R/t c + 4·R/t f)
  attention           (2·D/t + 2·d) c + 2·S f   (q, k, v; on XLA's path masked scores
                                           and probabilities)
  GateLoop            3·D/t c + 12·D/t f
(each temporal block states its row, and what "save_matmuls" keeps of it, as the
`memory` capability of its registry entry: `model.block_registry`, built-ins in
`model/blocks/<name>/spec.py`). A block that declares no `memory` (a research block
with only its layer and parameter count) is estimated, and the plan says so
(`plan["estimated"]`, a line of `format_plan`): with W = its matmul weights / D, the
summed output widths of its weight matrices (all its parameters when it declares no
counting), it keeps ESTIMATE_KEPT = (1, 4) x W per token (compute dtype, float32), not
split over `tensor`, and "save_matmuls" keeps W in the compute dtype. That covers the
declared recurrences with room (the RG-LRU keeps 5 + 2 buffers of R per token against
W ≈ 3R, GateLoop 3 + 12 of D against W = 6D), but not attention-like scores that grow
with the sequence: such a block declares its terms.
S = (N/t)·K is the score matrix's entries per query: K = 2·window on the blocked local
path (T > window), else T. Where training calls run a fused attention kernel
(`ModelConfig.attention`, on the config's target platform) no scores are kept: the
float32 term is the kernel's one log-sum-exp per query head, N/t.

The peak is the larger of two moments of the backward pass, each on top of what both
keep (the saved inputs below):
  the loss's backward:   the float32 logits, V/t per token (formed in float32 by the
                         output projection, live until the softmax's gradient has been
                         formed from them), and the tied table's float32 gradient from
                         the output projection, V·D/t, formed whole before FSDP's
                         reduce-scatter (`table_gradient_bytes`);
  a unit's backward:     the kept buffers of the units being recomputed.
Per remat policy, per token:
  "none":          every block's kept buffers, at the loss's backward;
  "full":          units·D c (each scanned unit's input) + the kept buffers of the
                   unscanned tail + the larger of
                     the loss's backward and, with the depth unrolled whole (no loop),
                     beside it the last unit's kept buffers and the recurrences of the
                     others: the last unit is recomputed before the loss's backward,
                     and libtpu places the Pallas scan's recomputation, which needs only
                     the unit's saved input, ahead of it for every unit (a block's
                     `memory` terms say so with `recomputed_ahead`; the RG-LRU's do);
                     and the kept buffers of the units recomputed together: those of
                     one loop iteration (`depth_unroll` of them; scores of at most
                     SCORE_UNITS = 2), or with the depth unrolled whole at most
                     RECOMPUTED_UNITS = 3 (mqa_7b cut to 3 layers recomputes all three
                     after the loss's backward; mqa_1_3b at 6 layers no more than that);
                   plus that many units' weights (`depth_unroll`);
  "save_matmuls":  each unit's matmul outputs (and Conv1D output, attention scores)
                   + the tail + the larger of the loss's backward (beside the last
                   unit's recomputed buffers when the depth is unrolled whole) and the
                   largest block's remaining kept buffers (recomputed).
Backward-pass temporaries of a block (gradients of its internals) do not appear: the TPU
compiler frees the recomputed buffers as the block's backward consumes them, and at the
peaks measured they fit inside the kept set.

How it was measured. Structure (what is live at the peak) from libtpu's buffer
assignment (the live-range dump at the peak, `XLA_FLAGS=--xla_dump_to`) of MQA, Hawk and
Griffin 1.3B cut to 3 layers on v5p-8 fsdp:4 and mqa_7b cut to 3 on fsdp:2,tensor:4,
remat full, with splash attention and the Pallas scan (2026-12-08): the 1.3B peaks are
the loss's backward, the float32 logits (1 GiB per chip) and the table's float32
gradient (256 MiB) beside the saved inputs, the gathered weights and the recomputed
buffers above; mqa_7b's is just after it, all three units recomputed. The per-block
counts are those buffers rounded to whole copies. The RG-LRU's row was read again after
its layout change (2bce3ec: bf16 gate pre-activations kept, float32 gate chain
recomputed, no channel padding in the scan) from griffin_1_3b cut to 3 layers, remat
none, and hawk_7b cut to 3 on fsdp:2,tensor:4, remat full: 5 compute-dtype and 2
float32 buffers of R/t per layer, all three of hawk_7b's units' at its peak. Against the
compiled peaks (benchmarks/results/planner_vs_compiler.json and the fused Figure-3 cuts,
benchmarks/results/tpu_figure3_fused.json; benchmarks/RESULTS.md, "Planner against the
compiler"; tests/test_memory_planner.py holds totals to 15% and activations to 25%):
griffin, hawk and mqa 1.3B at 3, 6 and 24 layers, 7B cut to 3, griffin 14B cut to 3,
remat full, none and save_matmuls, fsdp and fsdp x tensor meshes (the Griffin and Hawk
ones recompiled after 2bce3ec): totals 0.94x to 1.15x (griffin_14b, 1.1497x: just
inside the bound), activations 0.77x to 1.19x; the fused Figure-3 cuts (remat none, 3 and 6
layers, 2K to 8K tokens per row) 1.00x to 1.08x. The high end is the tensor-parallel 7B
and 14B cuts (1.12x to 1.15x): at hawk_7b's peak the RG-LRU buffers are as planned, but
of the residual and MLP buffers counted (4·D + 2·M/t per layer) less is live (the
up projections and two D-wide norm inputs per layer, little of the gate projections),
a term MQA shares and that is not refitted here. Fitted on the depth-3 1.3B records, the Figure-3
cuts, mqa_1_3b at 6 layers and mqa_7b (held out first, they missed and changed the
model); held out (predicted before their compiles finished): the other 6-layer and
24-layer 1.3B cuts, griffin and hawk 7B, griffin 14B. The low activations are the
looped Griffin preset (0.77x): its depth loop also holds the compute-dtype copy of every
unit's weight shard, which this model counts only for the units being computed. Not
met: hawk_400m on data:4 (1.15x total, 1.30x activations, before 2bce3ec), whose peak
holds no logits.
Against XLA:GPU (benchmarks/results/planner_vs_gpu_compiler.json, held to 25% by the
same test; XLA's attention, as those programs were compiled): Griffin, Hawk and MQA at
1.3B and 7B, whole presets at 256 x 2048 tokens on fsdp:4,tensor:8 over 32 H100s and
fsdp:8,tensor:8 over 64, remat full and none: 0.78x to 1.07x, with no GPU-specific term
but the RG-LRU's row off TPU (the row of before 2bce3ec, larger than the TPU's);
XLA:GPU keeps more of the RG-LRU than libtpu (Hawk without remat 0.78x, hawk_1_3b
recompiled after 2bce3ec). Without remat
that holds with the depth unrolled (`ModelConfig.depth_scan_unroll`'s default on GPU; a
loop made XLA:GPU keep 2.1-2.9x) and for the program's own peak: a step bigger than the
GPU compiles to less, XLA:GPU rematerialising toward the device's memory (the records
were compiled with that limit lifted; compiled under it, they stay over the memory, as
planned, but for hawk_1_3b after 2bce3ec, which XLA:GPU now fits into an H100 by
rematerialising it: 73.37 GiB against its own 102.27).
Not calibrated (no compiled point): GateLoop, the CG-LRU, sequence-parallel meshes, and
the chunked loss (the output term assumes TrainConfig.loss_chunks = 1). XLA:CPU keeps
about twice these activations for small float32 models (it fuses less), so
`pretrain.compilation.memory_plan`'s "compiled" method on CPU devices reads higher than this model.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model import block_registry
from model import counting, lm
from model.config import ModelConfig
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

PARAM_BYTES = 4          # float32 master weights
ADAM_MOMENTS = 2         # AdamW's mu and nu, float32, sharded like the params
UPDATE_WORKSPACE = 2     # temporaries of the optimizer update, in parameter shards
# Activation buffers per token, in units of one channel of the named width (compute-dtype
# elements, float32 elements); see the module docstring for what they stand for and how
# they were calibrated against libtpu's compiled peaks.
# The temporal blocks' own buffers are their registry entries' `memory` terms.
KEEP_RESIDUAL = 4            # x D, compute dtype: block input, mid residual, both norms
KEEP_MLP = 2                 # x M/t, compute dtype: gate and up projections
SCORE_UNITS = 2              # units of one loop iteration whose scores are live together
RECOMPUTED_UNITS = 3         # unrolled units recomputed together, at most
ESTIMATE_KEPT = (1, 4)       # x W (see above): a block that declares no memory terms
OUTPUT_LOGITS = 1            # x V/t, float32: the logits, live into the loss's backward
_KEYS = ("params", "optimizer", "gradients", "activations", "workspace", "total")


def resolve_mesh(mesh: Mapping[str, int]) -> dict[str, int]:
  """All five axis sizes; axes left out are 1. -1 cannot be resolved without devices."""
  unknown = set(mesh) - set(mesh_lib.MESH_AXES)
  if unknown:
    raise ValueError(f"mesh names unknown axes {sorted(unknown)}; axes are {mesh_lib.MESH_AXES}")
  sizes = {name: int(mesh.get(name, 1)) for name in mesh_lib.MESH_AXES}
  bad = {name: size for name, size in sizes.items() if size < 1}
  if bad:
    raise ValueError(f"mesh sizes must be positive for planning (no -1: the device count "
                     f"is what is being planned), got {bad}")
  return sizes


def _param_shapes_and_specs(config: ModelConfig):
  # Shapes and logical axes do not depend on how the step runs (remat, depth unrolling):
  # plans of one model under several policies trace it once.
  return _traced_shapes_and_specs(config.replace(remat="none", depth_scan_unroll=None))


@functools.lru_cache(maxsize=16)
def _traced_shapes_and_specs(config: ModelConfig):
  return lm.abstract_params_and_axes(config)


def _shard_elements(shape: Sequence[int], spec: jax.sharding.PartitionSpec,
                    sizes: Mapping[str, int], where: str) -> int:
  local = 1
  for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    shards = math.prod(sizes[a] for a in axes)
    if dim % shards:
      raise ValueError(f"{where}: size {dim} of shape {tuple(shape)} is not divisible by "
                       f"mesh axes {axes} ({shards} shards); choose a mesh that divides it")
    local *= dim // shards
  return local


def param_bytes_per_device(config: ModelConfig, mesh: Mapping[str, int],
                           rules: Optional[Sequence] = None) -> int:
  """Exact bytes of this device's shard of the float32 parameters."""
  sizes = resolve_mesh(mesh)
  shapes, logical = _param_shapes_and_specs(config)
  total = 0
  flat_logical = dict(jax.tree_util.tree_leaves_with_path(
      logical, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
  for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
    where = partition.path_str(path)
    spec = rules_lib.logical_to_mesh_spec(flat_logical[path], rules, where=where)
    spec = partition.with_fsdp_fallback(spec, flat_logical[path], leaf.shape,
                                        math.prod(leaf.shape) * PARAM_BYTES, sizes)
    total += _shard_elements(leaf.shape, spec, sizes, where) * PARAM_BYTES
  return total


class _Estimate:
  """The memory terms of a block that declares none (module docstring): buffers of its
  weights' summed output widths, unsplit."""

  def __init__(self, block_type: str):
    self.block_type = block_type

  def _widths(self, config: ModelConfig) -> float:
    return counting.block_matmul_params(config, self.block_type) / config.width

  def kept_activations(self, config: ModelConfig, seq: int, tensor: int
                       ) -> tuple[float, float, float]:
    del seq, tensor
    widths = self._widths(config)
    return ESTIMATE_KEPT[0] * widths, ESTIMATE_KEPT[1] * widths, 0.0

  def saved_matmul_outputs(self, config: ModelConfig, seq: int, tensor: int
                           ) -> tuple[float, float]:
    del seq, tensor
    return self._widths(config), 0.0


def _memory_terms(block_type: str) -> block_registry.BlockMemory:
  return block_registry.get(block_type).memory or _Estimate(block_type)


def estimated_blocks(config: ModelConfig) -> list[str]:
  """The block types of `config` planned by the estimate, having declared no `memory`."""
  return [block for block in dict.fromkeys(config.block_pattern)
          if block_registry.get(block).memory is None]


def _block_kept(config: ModelConfig, block_type: str, seq: int, tensor: int
                ) -> tuple[float, float, float]:
  """What one residual block keeps for its backward pass, per token on one device:
  (compute-dtype elements, float32 elements, of which float32 attention scores); the
  temporal block's part comes from its registry entry, or the estimate."""
  compute = KEEP_RESIDUAL * config.width + KEEP_MLP * config.mlp_width / tensor
  temporal = _memory_terms(block_type).kept_activations(config, seq, tensor)
  return compute + temporal[0], temporal[1], temporal[2]


def _recomputed_ahead(config: ModelConfig, block_type: str, seq: int, tensor: int) -> float:
  """Of what the temporal block keeps, the part whose recomputation the compiler
  schedules ahead of the loss's backward under remat "full" with the depth unrolled
  (in compute-dtype elements per token; float32 counts twice): a block's memory terms
  say so with `recomputed_ahead`, none by default."""
  terms = _memory_terms(block_type)
  if not getattr(terms, "recomputed_ahead", False):
    return 0.0
  c_bytes = np.dtype(jnp.dtype(config.dtype)).itemsize
  compute, f32, _ = terms.kept_activations(config, seq, tensor)
  return compute + f32 * 4 / c_bytes


def _saved_matmul_outputs(config: ModelConfig, block_type: str, seq: int, tensor: int
                          ) -> tuple[float, float]:
  """What remat "save_matmuls" keeps of one block per token: its weight matmuls' outputs
  (and the Conv1D's) in the compute dtype, and the attention's float32 scores."""
  temporal = _memory_terms(block_type).saved_matmul_outputs(config, seq, tensor)
  return temporal[0] + 2 * config.mlp_width / tensor + config.width, temporal[1]


def _activation_phases(config: ModelConfig, seq: int, tensor: int
                       ) -> tuple[float, float, float]:
  """Bytes per token on one device of the two candidate peaks (module docstring):
  (kept through both, the loss's backward adds, a scan iteration's backward adds)."""
  c_bytes = np.dtype(jnp.dtype(config.dtype)).itemsize
  kept = {b: _block_kept(config, b, seq, tensor) for b in set(config.block_types)}
  kept_bytes = lambda b: kept[b][0] * c_bytes + kept[b][1] * 4
  logits = OUTPUT_LOGITS * config.vocab_size / tensor * 4
  if config.remat == "none":
    # Every block's buffers are kept when the loss's backward starts.
    return sum(kept_bytes(b) for b in config.block_types), logits, 0.0
  # Rematerialised units keep their inputs (with save_matmuls, their matmul outputs);
  # the unscanned tail keeps everything. `last`: what the loss's backward finds
  # recomputed beside it when the depth is unrolled whole; `recomputed`: what a loop's
  # iteration recomputes together.
  units, unrolled = config.num_scanned_units, config.depth_unroll
  tail = sum(kept_bytes(b) for b in config.remainder_block_types)
  if config.remat == "full":
    saved = units * config.width * c_bytes
    last = sum(kept_bytes(b) for b in config.block_pattern)
    # Recurrences recomputed ahead: every other unrolled unit's share beside the last.
    last += (unrolled - 1) * sum(_recomputed_ahead(config, b, seq, tensor) * c_bytes
                                 for b in config.block_pattern)
    recomputed = sum(unrolled * kept_bytes(b)
                     - (unrolled - min(unrolled, SCORE_UNITS)) * kept[b][2] * 4
                     for b in config.block_pattern)
  elif config.remat == "save_matmuls":
    outputs = {b: _saved_matmul_outputs(config, b, seq, tensor) for b in config.block_pattern}
    saved = units * sum(outputs[b][0] * c_bytes + outputs[b][1] * 4
                        for b in config.block_pattern)
    recomputed = max(kept_bytes(b) - outputs[b][0] * c_bytes - outputs[b][1] * 4
                     for b in config.block_pattern)
    last = recomputed
  else:
    raise ValueError(f"unknown remat policy {config.remat!r}")
  if units and unrolled == units:
    # The depth unrolled whole: the last unit (and the recurrences ahead) is recomputed
    # before the loss's backward, and at most RECOMPUTED_UNITS units together after it.
    together = min(unrolled, RECOMPUTED_UNITS)
    return saved + tail, logits + last, recomputed * together / unrolled
  # A loop's body runs within the loop: nothing of it moves ahead of the loss.
  return saved + tail, logits, recomputed


def activation_bytes_per_token(config: ModelConfig, seq: int, tensor: int) -> float:
  """Peak bytes per token on one device of the activations of a training step (the
  per-token part of the module docstring's model; the units' weights and the table's
  gradient come on top)."""
  common, loss_phase, unit_phase = _activation_phases(config, seq, tensor)
  return common + max(loss_phase, unit_phase)


def unit_weight_bytes(config: ModelConfig, tensor: int) -> int:
  """One scanned unit's weights in the compute dtype, as gathered over the FSDP axes
  for its forward and backward (split over `tensor` only)."""
  c_bytes = np.dtype(jnp.dtype(config.dtype)).itemsize
  weights = sum(counting.block_matmul_params(config, b) + counting.mlp_matmul_params(config)
                for b in config.block_pattern)
  return int(weights * c_bytes / tensor)


def table_gradient_bytes(config: ModelConfig, sizes: Mapping[str, int]) -> int:
  """The tied table's float32 gradient from the output projection, formed whole (split
  over `tensor` only) during the loss's backward, before FSDP's reduce-scatter."""
  return int(config.vocab_size * config.width / sizes["tensor"] * PARAM_BYTES)


def activation_bytes_per_device(config: ModelConfig, mesh: Mapping[str, int], batch_size: int,
                                seq_len: int) -> int:
  """Analytic bytes of activations on one device at the training step's peak."""
  sizes = resolve_mesh(mesh)
  batch_shards = sizes["replica"] * sizes["data"] * sizes["fsdp"]
  if batch_size % batch_shards:
    raise ValueError(f"global batch {batch_size} is not divisible by the batch axes "
                     f"replica·data·fsdp = {batch_shards}; pick a multiple of {batch_shards}")
  if seq_len % sizes["sequence"]:
    raise ValueError(f"sequence length {seq_len} is not divisible by the sequence axis "
                     f"({sizes['sequence']})")
  tokens = batch_size * seq_len / (batch_shards * sizes["sequence"])
  common, loss_phase, unit_phase = _activation_phases(config, seq_len, sizes["tensor"])
  units = config.depth_unroll if config.remat == "full" else 1
  return int(tokens * common
             + max(tokens * loss_phase + table_gradient_bytes(config, sizes),
                   tokens * unit_phase)
             + units * unit_weight_bytes(config, sizes["tensor"]))


def _analytic(config, sizes, batch_size, seq_len, rules):
  params = param_bytes_per_device(config, sizes, rules)
  activations = activation_bytes_per_device(config, sizes, batch_size, seq_len)
  return {"params": params, "optimizer": ADAM_MOMENTS * params, "gradients": params,
          "activations": activations, "workspace": UPDATE_WORKSPACE * params}


def plan_memory(config: ModelConfig, mesh: Mapping[str, int], batch_size: int, seq_len: int,
                device_memory_gb: Optional[float] = None, *,
                rules: Optional[Sequence] = None) -> dict[str, Any]:
  """Per-device memory of training `config` on `mesh` with a global batch of
  `batch_size` rows of `seq_len` tokens, from the analytic model.

  Args:
    config: the model.
    mesh: axis sizes, e.g. `sharding.mesh.parse_mesh_flag("data:2,fsdp:4,tensor:1")`;
      axes left out have size 1.
    batch_size: global batch in sequences.
    seq_len: tokens per sequence.
    device_memory_gb: memory of one device in GB (1e9 bytes); sets `fits`.
    rules: logical-axis rules (default: the Gin-configured table).

  Returns:
    {"params", "optimizer", "gradients", "activations", "workspace", "total"} in bytes
    per device (total = params + optimizer + gradients + the larger of activations and
    the optimizer update's workspace, which are never live together), plus "fits"
    (bool, or None without `device_memory_gb`), "device_memory_bytes", "method"
    ("analytic"), "mesh" (all five axes) and "estimated" (the block types planned by
    the estimate for blocks that declare no memory terms; empty for the built-ins).
  """
  if batch_size < 1 or seq_len < 1:
    raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
  sizes = resolve_mesh(mesh)
  plan: dict[str, Any] = _analytic(config, sizes, batch_size, seq_len, rules)
  # The update's temporaries are allocated after the backward pass has freed the
  # activations: the two never add.
  plan["total"] = (plan["params"] + plan["optimizer"] + plan["gradients"]
                   + max(plan["activations"], plan["workspace"]))
  plan["method"] = "analytic"
  plan["mesh"] = sizes
  plan["estimated"] = estimated_blocks(config)
  plan["device_memory_bytes"] = (None if device_memory_gb is None
                                 else int(device_memory_gb * 1e9))
  plan["fits"] = None if device_memory_gb is None else plan["total"] <= device_memory_gb * 1e9
  return plan


def format_plan(plan: Mapping[str, Any]) -> str:
  """One line per memory component, in GiB."""
  lines = [f"per-device memory ({plan['method']}, mesh "
           + ",".join(f"{k}:{v}" for k, v in plan["mesh"].items() if v > 1 or k == "data") + ")"]
  for key in _KEYS:
    lines.append(f"  {key:<12} {plan[key] / 2**30:10.3f} GiB")
  if plan["fits"] is not None:
    lines.append(f"  fits in {plan['device_memory_bytes'] / 1e9:g} GB: "
                 f"{'yes' if plan['fits'] else 'NO'}")
  lines += [estimate_line(plan["estimated"])] if plan.get("estimated") else []
  return "\n".join(lines)


def estimate_line(blocks: Sequence[str]) -> str:
  """The one line that says which blocks' activations are estimated, not calibrated."""
  return (f"  estimated: block types {', '.join(map(repr, blocks))} declare no memory "
          "terms (BlockSpec.memory); their activations are a conservative estimate from "
          "their weights' widths (model.memory)")
