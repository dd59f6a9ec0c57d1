"""The Pallas scan (interpret mode on CPU) against the float64 reference.

All three launch strategies run: "sequential" (the TPU design: 8/16-row groups,
state in scratch across time blocks), "chunked" (reduce then scan, one row per step)
and "lookback" (single pass, chunks chained through published states). Time chunks
of 16 with T = 37 give three chunks and a padded tail; D = 130 or 200 is padded to
256 lanes. On a GPU or TPU the same tests run the real device kernels (a strategy
that device cannot run stays in interpret mode there).
"""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.scan import linear_scan
from model.scan import pallas_compat
from model.scan import linear_scan_pairs
from model.scan import reference
from model.scan import ScanOptions

CASES = [
    # strategy, batch, channels, dtype, reverse, with_h0, complex
    ("sequential", 2, 200, "float32", False, True, False),
    ("sequential", 1, 130, "bfloat16", True, True, False),
    ("sequential", 1, 130, "complex64", True, True, True),
    ("chunked", 2, 130, "float32", True, False, False),
    ("chunked", 1, 200, "bfloat16", False, True, False),
    ("chunked", 1, 130, "complex64", False, True, True),
    ("lookback", 2, 200, "float32", False, True, False),
    ("lookback", 1, 130, "bfloat16", True, True, False),
    ("lookback", 2, 130, "complex64", True, False, True),
]


# Strategies each accelerator's compiler cannot run (refused when traced there); on
# that accelerator they run in interpret mode, the others as real device kernels.
_INTERPRET_ONLY_ON = {"gpu": {"sequential"}, "tpu": {"lookback"}}


@pytest.fixture
def pallas_options(request) -> ScanOptions:
  """Options of the strategy `request.param`, in chunks of 16 steps."""
  on_device_unsupported = request.param in _INTERPRET_ONLY_ON.get(
      jax.default_backend(), set())
  return ScanOptions(pallas_strategy=request.param, pallas_time_chunk=16,
                     pallas_interpret=True if on_device_unsupported else None)


def _inputs(seed, batch, time, channels, complex_):
  rng = np.random.default_rng(seed)
  shape = (batch, time, channels)
  a = rng.uniform(0.5, 1.0, shape) * (rng.uniform(size=(batch, time, 1)) > 0.15)
  draw = lambda *s: rng.normal(size=s) + (1j * rng.normal(size=s) if complex_ else 0)
  if complex_:
    a = a * np.exp(1j * rng.uniform(-np.pi, np.pi, shape))
  return a, draw(*shape), draw(batch, channels), draw(*shape), draw(batch, channels)


def _assert_close(actual, expected, rtol, what):
  actual = np.asarray(actual).astype(np.complex128)
  err = np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30)
  assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol}"


@pytest.mark.parametrize(
    "pallas_options,batch,channels,dtype,reverse,with_h0,complex_", CASES,
    indirect=["pallas_options"])
@pytest.mark.slow
def test_values_and_gradients(pallas_options, batch, channels, dtype, reverse, with_h0,
                              complex_):
  a, x, h0, dh, dlast = _inputs(7, batch, 37, channels, complex_)
  state_dtype = np.complex64 if complex_ else np.float32
  a = a.astype(state_dtype)
  x, dh = jnp.asarray(x, dtype), jnp.asarray(dh, dtype)
  h0 = h0.astype(state_dtype) if with_h0 else None
  dlast = dlast.astype(state_dtype)

  @jax.jit
  def run(a, x, h0, dh, dlast):
    out, vjp = jax.vjp(lambda a, x, h0: linear_scan(
        a, x, h0, options=pallas_options, reverse=reverse, impl="pallas"), a, x, h0)
    return out, vjp((dh, dlast))

  (h, last), (da, dx, dh0) = run(a, x, h0, dh, dlast)
  assert h.dtype == x.dtype and last.dtype == state_dtype
  assert da.dtype == a.dtype and dx.dtype == x.dtype
  x_seen, dh_seen = np.asarray(x).astype(np.complex128), np.asarray(dh).astype(np.complex128)
  h_ref, last_ref = reference.scan(a, x_seen, h0, reverse)
  da_ref, dx_ref, dh0_ref = reference.scan_vjp(a, x_seen, h0, dh_seen, dlast, reverse)
  rtol = 1e-2 if dtype == "bfloat16" else 1e-5
  _assert_close(h, h_ref, rtol, "h")
  _assert_close(last, last_ref, 1e-5, "h_last (float32 state)")
  _assert_close(da, da_ref, rtol, "da")
  _assert_close(dx, dx_ref, rtol, "dx")
  if with_h0:
    _assert_close(dh0, dh0_ref, 1e-5 if dtype != "bfloat16" else rtol, "dh0")


@pytest.mark.parametrize("pallas_options", ["sequential"], indirect=True)
def test_pairs_and_short_sequences(pallas_options):
  """Real/imaginary planes through the pairs helper; T shorter than one chunk."""
  a, x, h0, *_ = _inputs(8, 2, 5, 3, True)
  (h_re, h_im), (l_re, l_im) = linear_scan_pairs(
      (a.real.astype(np.float32), a.imag.astype(np.float32)),
      (x.real.astype(np.float32), x.imag.astype(np.float32)),
      (h0.real.astype(np.float32), h0.imag.astype(np.float32)),
      options=pallas_options, impl="pallas")
  h_ref, last_ref = reference.scan(a.astype(np.complex64), x.astype(np.complex64),
                                   h0.astype(np.complex64))
  _assert_close(np.asarray(h_re) + 1j * np.asarray(h_im), h_ref, 1e-5, "h")
  _assert_close(np.asarray(l_re) + 1j * np.asarray(l_im), last_ref, 1e-5, "h_last")


@pytest.mark.parametrize("components", [1, 2])
def test_look_back_composes_published_chunk_maps(components):
  """The look-back walk on hand-made flags, as a GPU would see them mid-flight.

  In interpret mode programs run one after another, so a real launch only ever
  finds its predecessor finished (flag 2). Here lane 0's chunk 3 finds chunks 2 and
  1 with only their maps published (flag 1) and chunk 0 finished; lane 1's chunk 4
  finds maps only, all the way back to h0.
  """
  from jax.experimental import pallas as pl
  from model.scan import pallas_kernels
  from model.scan import pallas_lookback

  lanes, num_chunks = 2, 5
  grid = pallas_lookback.Grid(pallas_kernels.Tiling(
      chunk=16, rows=1, num_chunks=num_chunks, components=components, reverse=False,
      sequential=False), batch=1, row_blocks=lanes)
  rng = np.random.default_rng(5)
  draw = lambda *shape: [rng.normal(size=shape).astype(np.float32)
                         for _ in range(components)]
  prod, local, inclusive = (draw(lanes, num_chunks, 1, 128) for _ in range(3))
  base = draw(lanes, 1, 128)
  flags = np.array([[2, 1, 1, 0, 0], [1, 1, 1, 1, 0]], np.int32).reshape(-1)
  positions = (3, 4)

  def kernel(flags_ref, *refs):
    prod_refs, local_refs, inclusive_refs, base_refs, out_refs = (
        refs[i * components:(i + 1) * components] for i in range(5))
    for lane, position in enumerate(positions):
      start = pallas_lookback.look_back(
          flags_ref, prod_refs, local_refs, inclusive_refs, grid, jnp.int32(lane),
          jnp.int32(position), tuple(r[lane] for r in base_refs))
      for ref, value in zip(out_refs, start):
        ref[lane] = value

  out = pl.pallas_call(
      kernel, out_shape=[jax.ShapeDtypeStruct((lanes, 1, 128), jnp.float32)] * components,
      interpret=True)(flags, *prod, *local, *inclusive, *base)

  as_complex = lambda planes: planes[0] + (1j * planes[1] if components == 2 else 0)
  p, l, i, h0 = (as_complex(v).astype(np.complex128) for v in (prod, local, inclusive, base))
  want_lane0 = p[0, 2] * (p[0, 1] * i[0, 0] + l[0, 1]) + l[0, 2]
  want_lane1 = h0[1]
  for j in range(4):
    want_lane1 = p[1, j] * want_lane1 + l[1, j]
  _assert_close(as_complex(out)[0], want_lane0, 1e-5, "lane 0 start (via inclusive)")
  _assert_close(as_complex(out)[1], want_lane1, 1e-5, "lane 1 start (via h0)")


# Many chunks in flight. On a GPU every (row, chunk) program of one launch runs at
# once, so the look-back walk meets predecessors that have published only their map, or
# nothing yet, and a missing fence or a wrong flag order shows up as an error that moves
# between draws. Interpret mode runs programs one by one and can only check the maths,
# so on CPU the same test runs a few chunks; on a device, hundreds.
# Mosaic GPU only where this JAX install can lower it (an install without it gets a
# clear ValueError instead: test_mosaic_gpu_without_its_lowering_is_a_clear_error).
_MANY_CHUNKS_CASES = {
    "gpu": [("lookback", "triton", "float32"), ("lookback", "triton", "bfloat16"),
            ("chunked", "triton", "bfloat16")] + (
                [] if pallas_compat.mosaic_gpu_unavailable() else
                [("chunked", "mosaic_gpu", "float32"), ("chunked", "mosaic_gpu", "bfloat16")]),
}.get(jax.default_backend(), [("lookback", "auto", "float32"),
                              ("chunked", "auto", "bfloat16")])
_MANY_CHUNKS = 4 if jax.default_backend() == "cpu" else 256


@pytest.mark.parametrize("strategy,backend,dtype", _MANY_CHUNKS_CASES)
@pytest.mark.slow
def test_many_chunks_in_flight(strategy, backend, dtype):
  """Values and gradients over `_MANY_CHUNKS` chunks of 16, three fresh draws through
  one compiled program (a race gives a different error on each), with resets."""
  batch, channels, time = 2, 384, 16 * _MANY_CHUNKS
  interpret = True if strategy in _INTERPRET_ONLY_ON.get(jax.default_backend(), ()) else None
  options = ScanOptions(pallas_strategy=strategy, pallas_time_chunk=16,
                        pallas_gpu_backend=backend, pallas_interpret=interpret)

  @jax.jit
  def run(a, x, h0, dh, dlast):
    out, vjp = jax.vjp(lambda a, x, h0: linear_scan(
        a, x, h0, options=options, impl="pallas"), a, x, h0)
    return out, vjp((dh, dlast))

  rtol = 1e-2 if dtype == "bfloat16" else 1e-5
  for seed in range(3):
    a, x, h0, dh, dlast = _inputs(100 + seed, batch, time, channels, False)
    a, h0, dlast = (v.astype(np.float32) for v in (a, h0, dlast))
    x, dh = jnp.asarray(x, dtype), jnp.asarray(dh, dtype)
    (h, last), (da, dx, dh0) = run(a, x, h0, dh, dlast)
    x_seen, dh_seen = (np.asarray(v).astype(np.complex128) for v in (x, dh))
    h_ref, last_ref = reference.scan(a, x_seen, h0, False)
    da_ref, dx_ref, dh0_ref = reference.scan_vjp(a, x_seen, h0, dh_seen, dlast, False)
    for name, actual, expected in (("h", h, h_ref), ("h_last", last, last_ref),
                                   ("da", da, da_ref), ("dx", dx, dx_ref),
                                   ("dh0", dh0, dh0_ref)):
      _assert_close(actual, expected, rtol, f"draw {seed}: {name}")


def test_mosaic_gpu_without_its_lowering_is_a_clear_error(monkeypatch):
  """A JAX install whose Mosaic GPU lowering cannot be imported (an H200 image with JAX
  0.11.2 had none) must say so and name the way out, not fail an assertion in JAX."""
  real_import = importlib.import_module

  def import_module(name, *args, **kwargs):
    if name.endswith("mosaic_gpu.pallas_call_registration"):
      raise ImportError("no Mosaic GPU in this jaxlib")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(pallas_compat.importlib, "import_module", import_module)
  with pytest.raises(ValueError, match=r"cannot lower Mosaic GPU kernels \(ImportError: no "
                     r"Mosaic GPU in this jaxlib\); use pallas_gpu_backend='triton'"):
    pallas_compat.compiler_params("gpu", ("parallel",), "mosaic_gpu")
  assert pallas_compat.mosaic_gpu_unavailable() == "ImportError: no Mosaic GPU in this jaxlib"


@pytest.mark.parametrize("channels,rows,padded_rows,reverse,dtype", [
    (20 * 128, 10, 20, False, "float32"),   # D_RNN 2560 (1.3B): two blocks of 10 rows
    (12 * 128, 12, 12, True, "bfloat16"),   # D_RNN 1536 (400M): one block of all 12 rows
    (5 * 128 - 3, 5, 5, False, "float32"),  # under 8 rows: lanes padded only to 128
    (17 * 128, 8, 24, True, "float32"),     # no divisor in 8..16: padded to 8-row blocks
])
@pytest.mark.slow
def test_tpu_tiling_pads_no_channel_rows(channels, rows, padded_rows, reverse, dtype):
  """The TPU (sequential) launch, in interpret mode: where 8 rows of 128 channels do not
  divide the width, a block takes a divisor of it (state arrays [B, R/rows, rows, 128])
  instead of padding channels to a multiple of 8 rows; values and gradients stay exact."""
  from model.scan import pallas_scan
  options = ScanOptions(pallas_time_chunk=16, lowering_platform="tpu",
                        pallas_interpret=True)
  launch = pallas_scan._Launch(2, 37, channels, jnp.dtype(dtype), 1, reverse, options)
  assert launch.strategy == "sequential" and launch.tiling.rows == rows
  assert launch.padded_rows == padded_rows
  test_values_and_gradients(options, 2, channels, dtype, reverse, True, False)
