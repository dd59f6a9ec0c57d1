"""Ahead-of-time compilation of the trainer's step for a TPU or GPU target, and its cost.

`compile_train_step` compiles `pretrain.steps.jit_train_step`, the very program the
trainer runs (optimizer, microbatches, remat, dtypes, shardings), over a mesh of device
descriptions of a TPU slice (`pretrain.compilation.tpu_target`: XLA:TPU and Mosaic) or of GPUs
(`pretrain.compilation.gpu_target`: XLA:GPU, Triton, Mosaic GPU and ptxas), with no accelerator
attached. The report holds XLA's own per-device memory and cost figures.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import resource
import time
from typing import Any, Iterator, Optional

import jax

from model.config import ModelConfig
from plumbing.resident import ResidentPeak
from pretrain.observability import flops as flops_lib
from pretrain.compilation import kernel_estimates
from pretrain.compilation.gpu_target import GpuTarget
from pretrain.optimizer import OptimizerConfig, learning_rate_schedule, model_optimizer
from pretrain.runtime import Runtime
from pretrain.steps import abstract_batch, jit_train_step
from pretrain.compilation.tpu_target import HBM_BANDWIDTH, TpuTarget
from pretrain.train_config import TrainConfig
from sharding import partition
from sharding import rules as rules_lib
from sharding.mesh import MeshConfig, create_mesh

# The custom calls that carry a Pallas kernel in a compiled program, and the kernel
# compiler each names: Mosaic on TPU, Triton or Mosaic GPU on GPU.
# (Prefixes of the call target: Mosaic GPU versions its call, `mosaic_gpu_v2` in JAX 0.10.)
KERNEL_CALLS = {"tpu_custom_call": "Mosaic", "__gpu$xla.gpu.triton": "Triton",
                "mosaic_gpu": "Mosaic GPU"}
# A while loop in compiled HLO text (its body's costs count once in `cost_analysis`).
_WHILE = re.compile(r" while\(")


def for_target(config: ModelConfig, platform: str) -> ModelConfig:
  """`config` as the trainer resolves it on `platform` ("tpu" or "gpu"): the scan
  lowered for that platform (so "auto" picks what it picks there, and no interpret
  mode), whatever this host's backend is."""
  return config.replace(scan=dataclasses.replace(config.scan, lowering_platform=platform))


def kernel_calls(hlo_text: str) -> dict[str, int]:
  """{kernel compiler: custom calls} of the Pallas kernels in a compiled program."""
  counts = {name: hlo_text.count(f'custom_call_target="{target}')
            for target, name in KERNEL_CALLS.items()}
  return {name: count for name, count in counts.items() if count}


@dataclasses.dataclass(frozen=True)
class CompileReport:
  """What XLA says about one compiled train step, per device unless named otherwise.

  Memory figures are XLA's buffer assignment (`memory_analysis`): arguments (state and
  batch), outputs (aliasing the donated state), temporaries, and the peak of live
  buffers. `compiled_flops` is XLA's `cost_analysis` of the partitioned per-device
  program (a loop body counts once per trip XLA knows; None where the compiler gives
  none, as XLA:GPU does for an ahead-of-time compile); `model_flops` is the step's
  training FLOPs over all devices as the trainer's MFU counts them. `kernels` counts
  the Pallas custom calls in the compiled program by kernel compiler (`KERNEL_CALLS`).
  `estimated_seconds` and `bytes_accessed` are XLA's cost model of the step on the
  target (`optimal_seconds`, HBM `bytes accessed`; None where the compiler gives none):
  the compiler's estimate, not a measurement, deterministic, and whole only when
  `while_loops` is 0 (XLA counts a loop body once, whatever its trip count: a scanned
  depth or microbatch loop undercounts). Pallas kernels enter it through their
  declared `CostEstimate`; JAX's splash attention declares none, so its launches are
  priced from their block arithmetic (`kernel_estimates`, `declared_kernels`) and their
  roofline time and bytes are added: `estimated_seconds` and `bytes_accessed` are XLA's
  figures (`xla_estimated_seconds`, `xla_bytes_accessed`) plus those.
  `attention` names the implementation the step's attention runs (`impl`) and why
  (`reason`, where XLA's path runs in place of a fused kernel); None without attention.
  `compile_seconds` is wall time of lowering and compiling; `compile_cpu_seconds` the
  CPU time this process (all threads) and its ptxas children spent on it: on a shared
  host the wall time mostly measures the other jobs (a `nice -n 19` compile on an
  oversubscribed 2-core machine ran at a fifth of a core), the CPU time what the
  compile costs. `compile_host_peak_bytes` is this process's largest resident memory
  sampled while it lowered and compiled (the compiler's host memory, with what the
  process already held).
  """
  target: str
  platform: str
  num_slices: int
  devices: int
  mesh: dict[str, int]
  model: dict[str, Any]
  batch_size: int
  sequence_length: int
  microbatches: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  peak_bytes: int
  hbm_bytes: int
  compiled_flops: Optional[float]
  model_flops: float
  estimated_seconds: Optional[float]
  bytes_accessed: Optional[float]
  peak_flops: Optional[float]
  while_loops: int
  compile_seconds: float
  compile_cpu_seconds: float
  compile_host_peak_bytes: int
  kernels: dict[str, int]
  attention: Optional[dict[str, str]] = None
  declared_kernels: Optional[dict[str, Any]] = None
  xla_estimated_seconds: Optional[float] = None
  xla_bytes_accessed: Optional[float] = None

  @property
  def fits(self) -> bool:
    return self.peak_bytes <= self.hbm_bytes

  @property
  def tokens(self) -> int:
    return self.batch_size * self.sequence_length

  @property
  def estimated_mfu(self) -> Optional[float]:
    """Model FLOPs over (estimated step time x peak FLOP/s of every device)."""
    if not self.estimated_seconds or not self.peak_flops:
      return None
    return self.model_flops / (self.estimated_seconds * self.peak_flops * self.devices)

  @property
  def estimated_tokens_per_second(self) -> Optional[float]:
    return self.tokens / self.estimated_seconds if self.estimated_seconds else None

  @property
  def bytes_accessed_per_token(self) -> Optional[float]:
    """HBM bytes one device moves per token of its share of the batch."""
    if self.bytes_accessed is None:
      return None
    return self.bytes_accessed * self.devices / self.tokens

  def as_dict(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "fits": self.fits,
            "estimated_mfu": self.estimated_mfu,
            "estimated_tokens_per_second": self.estimated_tokens_per_second,
            "bytes_accessed_per_token": self.bytes_accessed_per_token}


def target_runtime(config: ModelConfig, mesh_config: MeshConfig, devices: list[Any],
                   rules: rules_lib.Rules = rules_lib.DEFAULT_RULES,
                   replication_check: partition.ReplicationCheck = partition.ReplicationCheck()
                   ) -> Runtime:
  """The trainer's Runtime over a mesh of the target's device descriptions."""
  platform = "tpu" if devices[0].platform == "tpu" else "gpu"
  return Runtime(for_target(config, platform), create_mesh(mesh_config, devices), rules,
                 replication_check)


@contextlib.contextmanager
def without_persistent_cache() -> Iterator[None]:
  """Keeps JAX's persistent compilation cache (on by default for the trainer) out of an
  ahead-of-time compile: an executable compiled against TPU or GPU descriptions cannot
  be loaded back without such a client (JAX warns and compiles again), and a hit would
  fake the compile time reported. JAX reads the enable flag once per process, at its
  first compile, so where a compile came earlier (the tests) the cache stays on; the
  minimum compile time of a cache write is then raised past any compile, so nothing
  is written and nothing can be read back."""
  enabled = jax.config.jax_enable_compilation_cache
  min_seconds = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_enable_compilation_cache", False)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_seconds)


@dataclasses.dataclass(frozen=True)
class CompileCost:
  """What one compile cost this host: wall and CPU seconds (`_cpu_seconds`), and the
  process's peak resident memory while it ran."""
  seconds: float
  cpu_seconds: float
  host_peak_bytes: int


def compile_train_step(runtime: Runtime, train_config: TrainConfig,
                       optimizer_config: OptimizerConfig) -> tuple[Any, CompileCost]:
  """(the compiled train step, its cost on this host): the trainer's program, lowered
  on the abstract state and batch and compiled for the runtime's devices."""
  optimizer = model_optimizer(optimizer_config, train_config.train_steps, runtime.config,
                              runtime.abstract_params)
  program = jit_train_step(runtime, optimizer,
                           learning_rate_schedule(optimizer_config, train_config.train_steps),
                           train_config.microbatches, train_config.z_loss_weight,
                           train_config.loss_chunks)
  batch = abstract_batch(runtime, train_config.batch_size, train_config.sequence_length)
  start, cpu_start = time.perf_counter(), _cpu_seconds()
  with runtime.activation_context(), without_persistent_cache(), \
      ResidentPeak().watch() as resident:
    compiled = program.step.lower(program.abstract_state, batch).compile()
  return compiled, CompileCost(time.perf_counter() - start, _cpu_seconds() - cpu_start,
                               resident.peak_bytes)


def _cpu_seconds() -> float:
  """CPU seconds of this process and of the children it waited for: XLA:GPU runs
  ptxas as a child process for every kernel it builds."""
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return time.process_time() + children.ru_utime + children.ru_stime


def report(compiled: Any, cost: CompileCost, runtime: Runtime,
           target: TpuTarget | GpuTarget, train_config: TrainConfig) -> CompileReport:
  """The CompileReport of a train step compiled by `compile_train_step`."""
  memory = compiled.memory_analysis()
  costs = compiled.cost_analysis()
  costs = (costs[0] if isinstance(costs, (list, tuple)) else costs) or {}
  tokens = train_config.batch_size * train_config.sequence_length
  config = runtime.config
  text = compiled.as_text()
  peak_flops = flops_lib.peak_flops_per_device(runtime.mesh.devices.flat[0].device_kind)
  bandwidth = HBM_BANDWIDTH.get(target.generation) if isinstance(target, TpuTarget) else None
  with runtime.activation_context():
    attention = kernel_estimates.attention_plan(config, train_config.sequence_length)
    declared = kernel_estimates.declared_kernel_costs(
        text, config, train_config.batch_size // train_config.microbatches,
        train_config.sequence_length, peak_flops, bandwidth)
  xla_seconds, xla_bytes = costs.get("optimal_seconds"), costs.get("bytes accessed")
  estimated_seconds, bytes_accessed = xla_seconds, xla_bytes
  if declared is not None and xla_seconds is not None:
    estimated_seconds = xla_seconds + (declared.seconds or 0.0)
  if declared is not None and xla_bytes is not None:
    bytes_accessed = xla_bytes + declared.bytes
  return CompileReport(
      target=target.name, platform=runtime.config.scan.lowering_platform,
      num_slices=target.num_slices, devices=runtime.mesh.size,
      mesh=dict(runtime.mesh.shape),
      model={"width": config.width, "depth": config.depth,
             "block_pattern": list(config.block_pattern), "remat": config.remat,
             "scan_impl": config.scan_impl, "attention_impl": config.attention.impl,
             "dtype": config.dtype},
      batch_size=train_config.batch_size, sequence_length=train_config.sequence_length,
      microbatches=train_config.microbatches,
      argument_bytes=memory.argument_size_in_bytes, output_bytes=memory.output_size_in_bytes,
      alias_bytes=memory.alias_size_in_bytes, temp_bytes=memory.temp_size_in_bytes,
      peak_bytes=memory.peak_memory_in_bytes, hbm_bytes=target.hbm_bytes,
      compiled_flops=costs.get("flops"),
      model_flops=tokens * flops_lib.training_flops_per_token(config,
                                                               train_config.sequence_length),
      estimated_seconds=estimated_seconds,
      bytes_accessed=bytes_accessed,
      peak_flops=peak_flops,
      while_loops=len(_WHILE.findall(text)),
      compile_seconds=cost.seconds, compile_cpu_seconds=cost.cpu_seconds,
      compile_host_peak_bytes=cost.host_peak_bytes,
      kernels=kernel_calls(text),
      attention=attention,
      declared_kernels=None if declared is None else dataclasses.asdict(declared),
      xla_estimated_seconds=xla_seconds, xla_bytes_accessed=xla_bytes)
