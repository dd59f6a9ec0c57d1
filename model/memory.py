"""Per-device memory of a training step on a mesh, planned before any chip is rented.

Two methods, same result keys (bytes per device):

* "analytic": parameters, AdamW moments and gradients are counted exactly from the
  model's parameter shapes and the sharding rules (each leaf's per-device shard);
  activations at the peak of the backward pass are estimated per token from the block
  structure, with buffer counts calibrated against the TPU compiler (below). Instant
  for any size; the 14B preset on 128 devices plans in seconds.
* "compiled": the real train step (loss, gradients, AdamW update) is lowered and
  compiled ahead of time for the mesh on this machine's (simulated) devices, with
  abstract `jax.ShapeDtypeStruct` inputs carrying their shardings, and XLA's
  `memory_analysis()` gives the figure. Nothing is allocated, but the mesh must fit in
  the available devices and compiling must be affordable, so "auto" uses it only for
  small models on small meshes (on CPU devices: XLA:CPU's figure, not a TPU's; for a
  TPU slice use `pretrain.compile`).

Analytic model of the peak (bytes per device). The total is
    params + optimizer + gradients + max(activations, workspace)
because the AdamW update's temporaries (workspace: 2 x the parameter shard) are allocated
after the backward pass has freed the activations. Activations are a per-token part
times tokens per device, batch·seq / (replica·data·fsdp·sequence), plus one scanned
unit's weights in the compute dtype, split over `tensor` (the FSDP all-gather of the unit
being computed). Widths the rules split over `tensor` (M = MLP, R = RNN channels, query
heads, V = vocab) are divided by its size t. Per block and token, in buffers of that
width (c: compute dtype, f: float32):
                      kept for the backward pass          extra while its backward runs
  residual + MLP      4·D c + 2·M/t c                      2·M/t c + 2·M/t f
  recurrent           3·R/t c + 10·R/t f                   2·R/t c + 7·R/t f
  attention           (2·D/t + 2·d) c + 2·S f              2·S c
  GateLoop            3·D/t c + 12·D/t f                   the same again
S = (N/t)·K is the score matrix's entries per query: K = 2·window on the blocked local
path (T > window), else T. The output keeps one float32 copy of the logits' gradient
(V/t f) live through the whole backward pass and needs two more while it is formed. So:
  remat "none":          the logits' copy + the kept buffers of every block;
  "full":                units·D c (each scanned unit's input) + the kept buffers of the
                         unscanned tail + the logits' copy + the busiest single phase:
                         one block's kept + extra buffers, or the output's two copies;
  "save_matmuls":        as "full", with each unit's matmul outputs kept in place of its
                         input.
The TPU compiler schedules a rematerialised unit's recomputation next to each block's
backward, so only one block's buffers peak at a time (a max, not a sum over the unit).

Which numbers are measured. The structure (what is kept, that the phases do not add, that
the logits' gradient stays live) and the buffer counts were read from libtpu's buffer
assignment (its live-range dump at the peak) of Griffin, Hawk and MQA at 1.3B on v5p;
the per-block counts were then rounded to whole buffers so the totals land on the
compiled peaks: griffin, hawk and mqa 1.3B cut to one to three units, remat full, none
and save_matmuls, fsdp and fsdp x tensor meshes, and griffin 7B cut to one unit on
fsdp:2,tensor:4 (benchmarks/results/planner_vs_compiler.json; tests hold every record
to within 25%, total and activations; benchmarks/RESULTS.md has the table). Nothing
else is fitted: the GateLoop and CG-LRU rows are not calibrated (no compiled point),
and the output rows assume the plain loss (TrainConfig.loss_chunks = 1).
Known gaps: XLA:CPU keeps about twice these activations for small float32 models (it
fuses less); with depth_scan_unroll > 1 the TPU compiler may recompute several units
at once (griffin 1.3B at depth 6 unrolled: +2.7 GiB per chip in the buffer assignment),
which the model does not count; the blocked local attention's backward adds about one
float32 score matrix after buffer assignment (libtpu's low-level passes), covered by
the rounding above rather than modelled.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from model import counting, lm
from model.config import BlockType, ModelConfig
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

PARAM_BYTES = 4          # float32 master weights
ADAM_MOMENTS = 2         # AdamW's mu and nu, float32, sharded like the params
UPDATE_WORKSPACE = 2     # temporaries of the optimizer update, in parameter shards
COMPILED_MAX_PARAMS = 50_000_000
# Activation buffers per token, in units of one channel of the named width (compute-dtype
# elements, float32 elements); see the module docstring for what they stand for and which
# were calibrated against libtpu's compiled peaks.
KEEP_RESIDUAL = 4            # x D, compute dtype: block input, mid residual, both norms
KEEP_MLP = 2                 # x M/t, compute dtype: gate and up projections
BACKWARD_MLP = (2, 2)        # x M/t: GeLU and product gradients
KEEP_RNN = (3, 10)           # x R/t: branch outputs; gates, decay, normaliser, scan, h
BACKWARD_RNN = (2, 7)        # x R/t: the scan's and gates' gradients
KEEP_SCORES = 2              # x score, float32: masked scores and probabilities
BACKWARD_SCORES = (2, 0)     # x score, compute dtype: probabilities and their gradient
LOGITS_RESIDENT = 1          # x V/t, float32: the logits' gradient, live all backward
OUTPUT_BACKWARD = 2          # x V/t, float32: logits and log-softmax while it is formed
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


def _score_columns(config: ModelConfig, seq: int) -> int:
  """Key columns of the float32 score matrix one query materialises: 2·window on the
  blocked local path (T > window), else T (global, or a call within the window)."""
  window = config.attention_window
  return 2 * window if window is not None and seq > window else seq


def _block_buffers(config: ModelConfig, block_type: str, seq: int, tensor: int
                   ) -> tuple[tuple[float, float], tuple[float, float]]:
  """((kept), (backward extra)) of one residual block, each (compute-dtype elements,
  float32 elements) per token on one device; see the module docstring."""
  d, r, m, t = config.width, config.rnn_width, config.mlp_width, tensor
  mlp_kept = (KEEP_RESIDUAL * d + KEEP_MLP * m / t, 0.0)
  mlp_extra = (BACKWARD_MLP[0] * m / t, BACKWARD_MLP[1] * m / t)
  if block_type == BlockType.RECURRENT.value:
    kept = (KEEP_RNN[0] * r / t, KEEP_RNN[1] * r / t)
    extra = (BACKWARD_RNN[0] * r / t, BACKWARD_RNN[1] * r / t)
  elif block_type == BlockType.ATTENTION.value:
    scores = config.num_heads / t * _score_columns(config, seq)
    kept = (2 * d / t + 2 * config.head_dim, KEEP_SCORES * scores)
    extra = (BACKWARD_SCORES[0] * scores, BACKWARD_SCORES[1] * scores)
  elif block_type == BlockType.GATELOOP.value:
    kept = (3 * d / t, 12 * d / t)
    extra = (3 * d / t, 12 * d / t)
  else:
    raise ValueError(f"unknown block type {block_type!r}")
  return ((kept[0] + mlp_kept[0], kept[1] + mlp_kept[1]),
          (extra[0] + mlp_extra[0], extra[1] + mlp_extra[1]))


def _saved_matmul_outputs(config: ModelConfig, block_type: str, tensor: int
                          ) -> tuple[float, float]:
  """What remat "save_matmuls" keeps of one block per token: its weight matmuls' outputs."""
  d, r, m, t = config.width, config.rnn_width, config.mlp_width, tensor
  temporal = {BlockType.RECURRENT.value: (2 * r / t + d, 2 * r / t),
              BlockType.ATTENTION.value: (d / t + 2 * config.head_dim + d, 0.0),
              BlockType.GATELOOP.value: (3 * d / t + d, 2 * d / t)}[block_type]
  return temporal[0] + 2 * m / t + d, temporal[1]


def activation_bytes_per_token(config: ModelConfig, seq: int, tensor: int) -> float:
  """Peak bytes per token on one device of the activations of a training step (the
  per-token part of the module docstring's model; the unit's weights come on top)."""
  c_bytes = np.dtype(jnp.dtype(config.dtype)).itemsize
  as_bytes = lambda buffers: buffers[0] * c_bytes + buffers[1] * 4
  blocks = {b: tuple(map(as_bytes, _block_buffers(config, b, seq, tensor)))
            for b in set(config.block_types)}
  logits = config.vocab_size / tensor * 4
  resident = LOGITS_RESIDENT * logits
  if config.remat == "none":
    return resident + sum(blocks[b][0] for b in config.block_types)
  # Rematerialised units keep their inputs (with save_matmuls, their matmul outputs);
  # the unscanned tail keeps everything. The peak is the backward pass of one block of
  # the recomputed unit, or of the output.
  units = config.num_scanned_units
  if config.remat == "save_matmuls":
    saved = units * sum(as_bytes(_saved_matmul_outputs(config, b, tensor))
                        for b in config.block_pattern)
  elif config.remat == "full":
    saved = units * config.width * c_bytes
  else:
    raise ValueError(f"unknown remat policy {config.remat!r}")
  saved += sum(blocks[b][0] for b in config.remainder_block_types)
  busiest = max([OUTPUT_BACKWARD * logits] + [sum(blocks[b]) for b in config.block_pattern])
  return saved + resident + busiest


def unit_weight_bytes(config: ModelConfig, tensor: int) -> int:
  """One scanned unit's weights in the compute dtype, as gathered over the FSDP axes
  for its forward and backward (split over `tensor` only)."""
  c_bytes = np.dtype(jnp.dtype(config.dtype)).itemsize
  weights = sum(counting.block_matmul_params(config, b) + counting.mlp_matmul_params(config)
                for b in config.block_pattern)
  return int(weights * c_bytes / tensor)


def activation_bytes_per_device(config: ModelConfig, mesh: Mapping[str, int], batch_size: int,
                                seq_len: int) -> int:
  """Analytic bytes of activations kept for the backward pass on one device."""
  sizes = resolve_mesh(mesh)
  batch_shards = sizes["replica"] * sizes["data"] * sizes["fsdp"]
  if batch_size % batch_shards:
    raise ValueError(f"global batch {batch_size} is not divisible by the batch axes "
                     f"replica·data·fsdp = {batch_shards}; pick a multiple of {batch_shards}")
  if seq_len % sizes["sequence"]:
    raise ValueError(f"sequence length {seq_len} is not divisible by the sequence axis "
                     f"({sizes['sequence']})")
  tokens = batch_size * seq_len / (batch_shards * sizes["sequence"])
  per_token = activation_bytes_per_token(config, seq_len, sizes["tensor"])
  return int(tokens * per_token + unit_weight_bytes(config, sizes["tensor"]))


def _analytic(config, sizes, batch_size, seq_len, rules):
  params = param_bytes_per_device(config, sizes, rules)
  activations = activation_bytes_per_device(config, sizes, batch_size, seq_len)
  return {"params": params, "optimizer": ADAM_MOMENTS * params, "gradients": params,
          "activations": activations, "workspace": UPDATE_WORKSPACE * params}


def compiled_train_step_memory(config: ModelConfig, mesh: Mapping[str, int], batch_size: int,
                               seq_len: int, rules: Optional[Sequence] = None) -> dict[str, int]:
  """XLA's own per-device memory figures for the sharded train step, compiled ahead of
  time on this machine's devices (nothing allocated).

  Returns `memory_analysis()`'s argument, output, alias and temporary sizes, and
  `peak` = arguments + outputs - aliased + temporaries.
  """

  sizes = resolve_mesh(mesh)
  devices = math.prod(sizes.values())
  if devices > jax.device_count():
    raise ValueError(f"compiling for a {devices}-device mesh needs that many devices; this "
                     f"process has {jax.device_count()} (use the analytic method, or set "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={devices})")
  device_mesh = mesh_lib.create_mesh(mesh_lib.MeshConfig(**sizes), jax.devices()[:devices])
  shapes, logical = _param_shapes_and_specs(config)
  param_shardings = partition.param_shardings(device_mesh, logical, shapes, rules)
  optimizer = optax.adamw(1e-4, b2=0.95, weight_decay=0.1)
  abstract_params = jax.tree_util.tree_map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, param_shardings)
  opt_shapes = jax.eval_shape(optimizer.init, shapes)
  opt_shardings = partition.opt_state_shardings(optimizer, opt_shapes, param_shardings,
                                                device_mesh)
  abstract_opt = jax.tree_util.tree_map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt_shapes, opt_shardings)
  batch_sharding = partition.batch_sharding(device_mesh, 2, rules)
  tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=batch_sharding)
  model = lm.LanguageModel(config)

  def loss_fn(params, tokens):
    positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), tokens.shape)
    logits, _ = model.apply({"params": params}, tokens, positions)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, jnp.roll(tokens, -1, 1)[..., None], axis=-1))

  def train_step(params, opt_state, tokens):
    grads = jax.grad(loss_fn)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  with rules_lib.activation_sharding(device_mesh, rules):
    compiled = jax.jit(train_step, out_shardings=(param_shardings, opt_shardings),
                       donate_argnums=(0, 1)).lower(abstract_params, abstract_opt,
                                                    tokens).compile()
  stats = compiled.memory_analysis()
  result = {
      "arguments": int(stats.argument_size_in_bytes),
      "outputs": int(stats.output_size_in_bytes),
      "aliased": int(stats.alias_size_in_bytes),
      "temporaries": int(stats.temp_size_in_bytes),
  }
  result["peak"] = (result["arguments"] + result["outputs"] - result["aliased"] +
                    result["temporaries"])
  return result


def plan_memory(config: ModelConfig, mesh: Mapping[str, int], batch_size: int, seq_len: int,
                device_memory_gb: Optional[float] = None, *, method: str = "auto",
                rules: Optional[Sequence] = None) -> dict[str, Any]:
  """Per-device memory of training `config` on `mesh` with a global batch of
  `batch_size` rows of `seq_len` tokens.

  Args:
    config: the model.
    mesh: axis sizes, e.g. `sharding.mesh.parse_mesh_flag("data:2,fsdp:4,tensor:1")`;
      axes left out have size 1.
    batch_size: global batch in sequences.
    seq_len: tokens per sequence.
    device_memory_gb: memory of one device in GB (1e9 bytes); sets `fits`.
    method: "analytic", "compiled" or "auto" (compiled when the mesh fits on this
      machine's devices and the model has at most COMPILED_MAX_PARAMS parameters).
    rules: logical-axis rules (default: the Gin-configured table).

  Returns:
    {"params", "optimizer", "gradients", "activations", "workspace", "total"} in bytes
    per device (total = params + optimizer + gradients + the larger of activations and
    the optimizer update's workspace, which are never live together), plus "fits"
    (bool, or None without `device_memory_gb`), "device_memory_bytes", "method", "mesh"
    (all five axes) and, for "compiled", "compiled" (XLA's figures). With "compiled",
    params/optimizer/gradients are the exact shard sizes, activations is what XLA's
    peak leaves after them, and total is XLA's peak.
  """
  if method not in ("auto", "analytic", "compiled"):
    raise ValueError(f"plan_memory method must be auto, analytic or compiled, got {method!r}")
  if batch_size < 1 or seq_len < 1:
    raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
  sizes = resolve_mesh(mesh)
  plan: dict[str, Any] = _analytic(config, sizes, batch_size, seq_len, rules)
  if method == "auto":
    small = counting.count_params(config).total <= COMPILED_MAX_PARAMS
    method = "compiled" if small and math.prod(sizes.values()) <= jax.device_count() else "analytic"
  state = plan["params"] + plan["optimizer"] + plan["gradients"]
  if method == "compiled":
    compiled = compiled_train_step_memory(config, sizes, batch_size, seq_len, rules)
    plan["activations"] = max(0, compiled["peak"] - state)
    plan["total"] = compiled["peak"]
    plan["compiled"] = compiled
  else:
    # The update's temporaries are allocated after the backward pass has freed the
    # activations: the two never add.
    plan["total"] = state + max(plan["activations"], plan["workspace"])
  plan["method"] = method
  plan["mesh"] = sizes
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
  return "\n".join(lines)
