"""The Pallas scan kernels lower for TPU (Mosaic) and GPU (Triton, Mosaic GPU) on a CPU host.

The interpret-mode tests (tests/test_scan_pallas.py) check the kernels' numbers;
they never lower them for a real device. Here `jax.export` cross-lowers the forward
and the forward+backward of `linear_scan(..., impl="pallas")` for each platform,
with `ScanOptions.lowering_platform` set so tracing picks that platform's tiling and
compiler parameters, and the exported module is inspected:

- TPU: every kernel is a `tpu_custom_call`; its Mosaic module deserialises and
  verifies, has the expected grid semantics, and every vector load and store moves
  whole (8, 128) tiles of [B, T, D]'s own TPU layout (so XLA adds no relayout copy
  around the kernel; tests/test_scan_cost_estimate.py and benchmarks/scan_tpu_bytes.py
  check the compiled program).
- GPU Triton: every kernel is a `__gpu$xla.gpu.triton` call whose Triton module
  parses and verifies; the look-back kernels use acquire-release GPU-scope atomics,
  volatile reads of published states and a thread barrier before each flag raise.
- GPU Mosaic GPU: every kernel is a `mosaic_gpu_v2` call (Pallas verifies the
  module while lowering it).

What this cannot check on CPU: the device compilers themselves (libtpu's Mosaic
passes, Triton's and Mosaic GPU's PTX generation) run only when XLA compiles for a
real TPU or GPU. A platform whose lowering modules this install lacks is skipped,
naming the missing module.
"""
import base64
import importlib
import json
import re
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import version as jaxlib_version
from jaxlib.mlir import ir
from jaxlib.mlir import passmanager

from model.scan import linear_scan
from model.scan import reference
from model.scan import ScanOptions

TPU_CALL = "tpu_custom_call"
TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_GPU_CALL = "mosaic_gpu_v2"

# (export platform, strategy, GPU backend, custom-call target, modules lowering needs)
TARGETS = {
    "tpu-sequential": ("tpu", "sequential", "auto", TPU_CALL,
                       ("jax.experimental.pallas.tpu", "jaxlib.mlir._mlir_libs._tpu_ext")),
    "tpu-chunked": ("tpu", "chunked", "auto", TPU_CALL,
                    ("jax.experimental.pallas.tpu", "jaxlib.mlir._mlir_libs._tpu_ext")),
    "cuda-triton": ("cuda", "chunked", "triton", TRITON_CALL,
                    ("jax.experimental.pallas.triton", "jaxlib.triton.dialect")),
    "cuda-triton-lookback": ("cuda", "lookback", "triton", TRITON_CALL,
                             ("jax.experimental.pallas.triton", "jaxlib.triton.dialect")),
    "cuda-mosaic_gpu": ("cuda", "chunked", "mosaic_gpu", MOSAIC_GPU_CALL,
                        ("jax.experimental.pallas.mosaic_gpu",
                         "jaxlib.mlir._mlir_libs._mosaic_gpu_ext")),
}
# Kernel launches per export: sequential = one pass each way; chunked = summary + pass.
KERNELS = {("sequential", "forward"): 1, ("sequential", "forward+backward"): 2,
           ("chunked", "forward"): 2, ("chunked", "forward+backward"): 4,
           ("lookback", "forward"): 1, ("lookback", "forward+backward"): 2}


def _missing_module(names) -> Optional[str]:
  for name in names:
    try:
      importlib.import_module(name)
    except ImportError as e:
      return f"{name} cannot be imported ({e})"
  return None


def _skip_reason(target: str) -> Optional[str]:
  platform, _, backend, _, modules = TARGETS[target]
  missing = _missing_module(modules)
  if missing:
    return f"this JAX install cannot lower Pallas for {target}: {missing}"
  if backend == "triton" and jaxlib_version > (0, 10, 2):
    # Newer jaxlibs compile Triton to PTX while lowering, through the CUDA plugin.
    from jax._src.lib import triton  # pylint: disable=g-import-not-at-top
    if not triton.has_compilation_handler(platform):
      return ("this jaxlib compiles Triton while lowering and has no CUDA Triton "
              "compilation handler (jax_cuda plugin not installed)")
  return None


def _options(target: str, **overrides) -> ScanOptions:
  """Options lowering for `target`'s platform, strategy and GPU backend (chunks of 16)."""
  platform, strategy, backend, _, _ = TARGETS[target]
  return ScanOptions(**{"lowering_platform": platform, "pallas_strategy": strategy,
                        "pallas_gpu_backend": backend, "pallas_time_chunk": 16,
                        **overrides})


def _abstract(shape, dtype):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _export(target: str, direction: str, shape, x_dtype: str, reverse: bool,
            options: ScanOptions):
  """Exports forward or forward+backward (VJP of h and h_last) for `target`."""
  platform, _, _, call, _ = TARGETS[target]
  batch, _, channels = shape
  state_dtype = "complex64" if x_dtype == "complex64" else "float32"
  args = [_abstract(shape, state_dtype), _abstract(shape, x_dtype),
          _abstract((batch, channels), state_dtype)]
  scan = lambda a, x, h0: linear_scan(a, x, h0, options=options, reverse=reverse,
                                      impl="pallas")
  if direction == "forward":
    fn = scan
  else:
    args += [_abstract(shape, x_dtype), _abstract((batch, channels), state_dtype)]

    def fn(a, x, h0, dh, dlast):
      out, vjp = jax.vjp(scan, a, x, h0)
      return out, vjp((dh, dlast))

  checks = [] if call == TPU_CALL else [jax.export.DisabledSafetyCheck.custom_call(call)]
  return jax.export.export(jax.jit(fn), platforms=[platform],
                           disabled_checks=checks)(*args)


def _custom_calls(exported) -> list[ir.Operation]:
  """The custom-call ops of an exported module, in a context kept alive by the ops."""
  context = jax_mlir.make_ir_context()
  with context:
    module = ir.Module.parse(exported.mlir_module())
    calls = []

    def visit(op):
      if op.name == "stablehlo.custom_call":
        calls.append(op)
      return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
  return [(c, context, module) for c in calls]


def _target(call) -> str:
  return ir.StringAttr(call.attributes["call_target_name"]).value


def _mosaic_module(call) -> str:
  """The Mosaic TPU kernel of a `tpu_custom_call`, deserialised, verified, as text."""
  from jaxlib.mlir._mlir_libs import _tpu_ext  # pylint: disable=g-import-not-at-top
  config = json.loads(ir.StringAttr(call.attributes["backend_config"]).value)
  body = base64.b64decode(config["custom_call_config"]["body"])
  context = jax_mlir.make_ir_context()
  _tpu_ext.register_dialect(context)
  with context:
    context.allow_unregistered_dialects = True  # The versioned (serialised) form.
    module = ir.Module.parse(body)
    passmanager.PassManager.parse(
        "builtin.module(mosaic-serde{serialize=false})").run(module.operation)
    context.allow_unregistered_dialects = False
    assert module.operation.verify()
    return str(module)


_ACCESS = re.compile(r"(vector\.load|vector\.store|tpu\.vector_store) .*?: "
                     r"memref<([0-9x]+)x\w+(?:, #tpu\.memory_space<\w+>)?>, "
                     r"vector<([0-9x]+)x\w+>")


def _assert_whole_tile_accesses(kernel: str, rows: int) -> None:
  """Every load/store moves whole tiles of its memory: a time block ([C/8, rows, 8,
  128], [B, T, D]'s own (8, 128) tiling) a whole tile of every row at once, a state
  block or scratch ([rows, 128], after squeezed dimensions) all of it. The 8 steps of a tile are taken apart in
  registers, never by an unaligned load."""
  accesses = _ACCESS.findall(kernel)
  assert accesses, "no vector loads/stores found in the Mosaic kernel"
  assert len(accesses) == sum(kernel.count(f"{op} %") for op in (
      "vector.load", "vector.store", "tpu.vector_store")), "an access was not parsed"
  for op, memref, vector in accesses:
    memref_dims = [int(d) for d in memref.split("x")]
    vector_dims = [int(d) for d in vector.split("x")]
    assert memref_dims[-2:] == vector_dims[-2:], (op, memref, vector)
    # A time block is [1, C/8, rows, 8, 128] (C >= 16); a sequential launch's state
    # blocks are [1, (1,) 1, rows, 128] ([B, (T/C,) R/rows, rows, 128] arrays).
    if len(memref_dims) == 5 and memref_dims[1] > 1:
      assert vector_dims[-3:] == [rows, 8, 128], (op, memref, vector)
    else:
      assert vector_dims[-2:] == [rows, 128], (op, memref, vector)


def _triton_module_verifies(call) -> str:
  from jaxlib.triton import dialect  # pylint: disable=g-import-not-at-top
  config = ir.DictAttr(call.attributes["mhlo.backend_config"])
  context = jax_mlir.make_ir_context()
  dialect.register_dialect(context)
  with context:
    module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
    assert module.operation.verify()
    return str(module)


CASES = [(target, direction, dtype)
         for target in TARGETS
         for direction in ("forward", "forward+backward")
         for dtype in ("float32", "bfloat16", "complex64")]


@pytest.mark.parametrize("target,direction,x_dtype", CASES)
def test_exports_with_device_kernels(target, direction, x_dtype):
  """T = 37 (three chunks of 16, padded), D = 200 (two 128-lane rows, padded)."""
  reason = _skip_reason(target)
  if reason:
    pytest.skip(reason)
  platform, strategy, _, call_name, _ = TARGETS[target]
  exported = _export(target, direction, (2, 37, 200), x_dtype,
                     reverse=x_dtype == "bfloat16", options=_options(target))
  assert exported.platforms == (platform,)
  calls = _custom_calls(exported)
  targets = [_target(c) for c, _, _ in calls]
  # No kernel may fall back to interpret mode (which emits no custom call).
  assert targets == [call_name] * KERNELS[(strategy, direction)], targets
  for call, _, _ in calls:
    if call_name == TPU_CALL:
      kernel = _mosaic_module(call)
      semantics = re.search(r"dimension_semantics = \[([^\]]*)\]", kernel).group(1)
      last = "arbitrary" if strategy == "sequential" else "parallel"
      assert semantics.count("parallel") == (2 if last == "arbitrary" else 3), semantics
      assert semantics.endswith(f"<{last}>"), semantics
      # D = 200 is two rows of 128 lanes; on TPU the block spans both (full width).
      _assert_whole_tile_accesses(kernel, rows=2)
    elif call_name == TRITON_CALL and strategy == "lookback":
      kernel = _triton_module_verifies(call)
      # The ticket, the flag reads and the two flag raises are GPU-scope
      # acquire-release atomics; published states are read back volatile.
      atomics = re.findall(r"tt\.atomic_rmw (\w+), (\w+), (\w+)", kernel)
      assert {op for op, _, _ in atomics} == {"add", "max"}, atomics
      assert all(sem == "acq_rel" and scope == "gpu" for _, sem, scope in atomics)
      assert "scf.while" in kernel and "isVolatile = true" in kernel
      # Threads sync before each of the two flag raises.
      assert kernel.count("gpu.barrier") == 2, kernel.count("gpu.barrier")
    elif call_name == TRITON_CALL:
      assert "scf.for" in _triton_module_verifies(call)


def test_tpu_wide_channels_use_full_sublane_tiles():
  """D = 1100 (9 rows of 128): 8 rows do not divide 9, so the TPU block is all 9 rows
  (no channel padding: before, D was padded to 16 rows in blocks of 8), and every
  access is still a whole (8, 128) tile, with the default channel block of 128."""
  reason = _skip_reason("tpu-sequential")
  if reason:
    pytest.skip(reason)
  exported = _export("tpu-sequential", "forward+backward", (1, 40, 1100), "bfloat16",
                     reverse=False, options=_options("tpu-sequential"))
  calls = _custom_calls(exported)
  assert [_target(c) for c, _, _ in calls] == [TPU_CALL] * 2
  for call, _, _ in calls:
    kernel = _mosaic_module(call)
    assert "iteration_bounds = array<i64: 1, 1, 3>" in kernel
    _assert_whole_tile_accesses(kernel, rows=9)


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("x_dtype", ["float32"] + [   # the fast tier keeps float32
    pytest.param(dtype, marks=pytest.mark.slow) for dtype in ("bfloat16", "complex64")])
def test_exports_at_production_tiling(target, x_dtype):
  """Time chunks of 128 and 1024-channel blocks (T = 512, D = 1100): the sizes
  where device limits bite (Mosaic GPU stages whole blocks in shared memory and
  must shrink them; TPU blocks are full (8, 128) tiles)."""
  reason = _skip_reason(target)
  if reason:
    pytest.skip(reason)
  _, strategy, _, call_name, _ = TARGETS[target]
  options = _options(target, pallas_time_chunk=128, pallas_channel_block=1024)
  exported = _export(target, "forward+backward", (2, 512, 1100), x_dtype, reverse=True,
                     options=options)
  calls = _custom_calls(exported)
  assert [_target(c) for c, _, _ in calls] == (
      [call_name] * KERNELS[(strategy, "forward+backward")])
  if call_name == TPU_CALL:
    # Sequential: one block of all 9 rows (8 do not divide 9); chunked: 8-row blocks.
    for call, _, _ in calls:
      _assert_whole_tile_accesses(_mosaic_module(call),
                                  rows=9 if strategy == "sequential" else 8)


def test_tpu_tiling_interpreted_matches_reference():
  """The multi-row TPU tiling (one block of all 9 channel rows) computes the same
  values and gradients as the float64 reference, run in interpret mode."""
  options = _options("tpu-sequential", pallas_interpret=True)
  rng = np.random.default_rng(3)
  shape = (1, 37, 1100)
  a = (rng.uniform(0.5, 1.0, shape) * (rng.uniform(size=(1, 37, 1)) > 0.15)).astype(np.float32)
  x, dh = rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)
  h0, dlast = (rng.normal(size=(1, 1100)).astype(np.float32) for _ in range(2))

  @jax.jit
  def run(a, x, h0, dh, dlast):
    out, vjp = jax.vjp(lambda a, x, h0: linear_scan(a, x, h0, options=options,
                                                    impl="pallas"), a, x, h0)
    return out, vjp((dh, dlast))

  got = jax.tree.leaves(run(a, x, h0, dh, dlast))
  want = list(reference.scan(a, x, h0)) + list(reference.scan_vjp(a, x, h0, dh, dlast))
  for name, g, w in zip(["h", "h_last", "da", "dx", "dh0"], got, want):
    err = np.abs(np.asarray(g, np.float64) - w).max() / np.abs(w).max()
    assert err <= 1e-5, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("platform,strategy,backend,message", [
    ("tpu", "lookback", "auto", "needs global atomics"),
    ("cuda", "lookback", "mosaic_gpu", "needs global atomics"),
    ("cuda", "sequential", "auto", "Pallas GPU lacks"),
])
def test_strategy_a_target_cannot_run_is_refused(platform, strategy, backend, message):
  """Asking for a strategy the target has no primitives for fails while tracing,
  naming the strategy and what to use instead."""
  options = ScanOptions(lowering_platform=platform, pallas_strategy=strategy,
                        pallas_gpu_backend=backend)
  x = jnp.ones((1, 16, 128), jnp.float32)
  with pytest.raises(ValueError, match=f"pallas_strategy='{strategy}'.*{message}"):
    jax.eval_shape(lambda a, x: linear_scan(a, x, options=options, impl="pallas"), x, x)
