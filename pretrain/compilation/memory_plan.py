"""The memory planner's two methods: `model.memory`'s analytic model, and the trainer's
own train step compiled ahead of time (`pretrain.compilation.aot`).

The analytic model lives in `model/` (it needs only shapes and sharding rules); the
compiled method must compile exactly the program that trains (its loss, microbatches,
z-loss, chunked loss and optimizer), which is `pretrain.steps.jit_train_step`, so it
lives here, above the trainer, and `pretrain.summary` and the benchmarks ask this module.
Compiling runs on this machine's devices (XLA:CPU's figures on a CPU host; for a TPU
slice or GPUs use `pretrain.compile --topology=...`, which goes through the same
`pretrain.compilation.aot.compile_train_step`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

import jax

from model import counting
from model import memory
from model.config import ModelConfig
from pretrain.compilation import aot
from pretrain.optimizer import OptimizerConfig
from pretrain.runtime import Runtime
from pretrain.train_config import TrainConfig
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

# "auto" compiles only models up to this size (a compile on CPU takes seconds there).
COMPILED_MAX_PARAMS = 50_000_000
METHODS = ("auto", "analytic", "compiled")


def compiled_step_memory(config: ModelConfig, mesh: Mapping[str, int], batch_size: int,
                         seq_len: int, rules: Optional[Sequence] = None,
                         train_config: Optional[TrainConfig] = None,
                         optimizer_config: Optional[OptimizerConfig] = None
                         ) -> dict[str, int]:
  """XLA's per-device memory figures of the trainer's train step, compiled ahead of time
  on this machine's devices for `mesh` (nothing allocated).

  `train_config` (default: TrainConfig's defaults) sets the loss options; its batch
  size and sequence length are replaced by `batch_size` and `seq_len`. Returns
  `memory_analysis()`'s argument, output, alias and temporary sizes, and
  `peak` = arguments + outputs - aliased + temporaries.
  """
  sizes = memory.resolve_mesh(mesh)
  devices = math.prod(sizes.values())
  if devices > jax.device_count():
    raise ValueError(f"compiling for a {devices}-device mesh needs that many devices; this "
                     f"process has {jax.device_count()} (use the analytic method, or set "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={devices})")
  device_mesh = mesh_lib.create_mesh(mesh_lib.MeshConfig(**sizes), jax.devices()[:devices])
  runtime = Runtime(config, device_mesh,
                    rules_lib.DEFAULT_RULES if rules is None else tuple(rules),
                    partition.ReplicationCheck())
  train_config = dataclasses.replace(train_config or TrainConfig(), batch_size=batch_size,
                                    sequence_length=seq_len)
  compiled, _ = aot.compile_train_step(runtime, train_config,
                                       optimizer_config or OptimizerConfig())
  stats = compiled.memory_analysis()
  result = {"arguments": int(stats.argument_size_in_bytes),
            "outputs": int(stats.output_size_in_bytes),
            "aliased": int(stats.alias_size_in_bytes),
            "temporaries": int(stats.temp_size_in_bytes)}
  result["peak"] = (result["arguments"] + result["outputs"] - result["aliased"] +
                    result["temporaries"])
  return result


def plan_memory(config: ModelConfig, mesh: Mapping[str, int], batch_size: int, seq_len: int,
                device_memory_gb: Optional[float] = None, *, method: str = "auto",
                rules: Optional[Sequence] = None) -> dict[str, Any]:
  """`model.memory.plan_memory`, or the compiled step's figures with `method`.

  Args:
    method: "analytic", "compiled" or "auto" (compiled when the mesh fits on this
      machine's devices and the model has at most COMPILED_MAX_PARAMS parameters).
    Others: as `model.memory.plan_memory`.

  Returns:
    The analytic plan's keys, plus "method"; with "compiled", params/optimizer/gradients
    stay the exact shard sizes, activations is what XLA's peak leaves after them, total
    is XLA's peak, and "compiled" holds XLA's figures.
  """
  if method not in METHODS:
    raise ValueError(f"plan_memory method must be auto, analytic or compiled, got {method!r}")
  plan = memory.plan_memory(config, mesh, batch_size, seq_len, device_memory_gb, rules=rules)
  if method == "auto":
    small = counting.count_params(config).total <= COMPILED_MAX_PARAMS
    method = ("compiled" if small and math.prod(plan["mesh"].values()) <= jax.device_count()
              else "analytic")
  if method == "compiled":
    compiled = compiled_step_memory(config, plan["mesh"], batch_size, seq_len, rules)
    state = plan["params"] + plan["optimizer"] + plan["gradients"]
    plan["activations"] = max(0, compiled["peak"] - state)
    plan["total"] = compiled["peak"]
    plan["compiled"] = compiled
    plan["estimated"] = []   # XLA's figures cover every block, declared terms or not
    if device_memory_gb is not None:
      plan["fits"] = plan["total"] <= device_memory_gb * 1e9
  plan["method"] = method
  return plan
