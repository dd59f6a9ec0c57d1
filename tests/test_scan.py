"""The XLA scan engines ("lax", "lax:N", "associative") against the float64 reference."""
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.scan import engine
from model.scan import linear_scan
from model.scan import linear_scan_pairs
from model.scan import reference


def _inputs(seed, batch, time, channels, *, complex_=False, resets=True, dtype=np.float32):
  """Decays in [0.5, 1) with document resets (a = 0) at random steps; normal x, h0."""
  rng = np.random.default_rng(seed)
  shape = (batch, time, channels)
  a = rng.uniform(0.5, 1.0, shape)
  if resets:
    a = a * (rng.uniform(size=(batch, time, 1)) > 0.2)
  x = rng.normal(size=shape)
  h0 = rng.normal(size=(batch, channels))
  dh = rng.normal(size=shape)
  dlast = rng.normal(size=(batch, channels))
  if complex_:
    phase = np.exp(1j * rng.uniform(-np.pi, np.pi, shape))
    a = a * phase
    x = x + 1j * rng.normal(size=shape)
    h0 = h0 + 1j * rng.normal(size=h0.shape)
    dh = dh + 1j * rng.normal(size=shape)
    dlast = dlast + 1j * rng.normal(size=dlast.shape)
    cast = lambda v: v.astype(np.complex64)
    return cast(a), cast(x), cast(h0), cast(dh), cast(dlast)
  return (a.astype(np.float32), x.astype(dtype), h0.astype(np.float32),
          dh.astype(dtype), dlast.astype(np.float32))


def _assert_close(actual, expected, rtol, what):
  actual = np.asarray(actual, np.complex128 if np.iscomplexobj(actual) else np.float64)
  scale = np.abs(expected).max()
  err = np.abs(actual - expected).max() / max(scale, 1e-30)
  assert err <= rtol, f"{what}: max error {err:.3g} of scale {scale:.3g} > {rtol}"


@pytest.mark.parametrize("impl", ["lax", "associative"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("complex_", [False, True])
def test_values_and_gradients_float32(impl, reverse, complex_):
  a, x, h0, dh, dlast = _inputs(0, 2, 23, 5, complex_=complex_)
  (h, last), vjp = jax.vjp(
      lambda a, x, h0: linear_scan(a, x, h0, reverse=reverse, impl=impl), a, x, h0)
  h_ref, last_ref = reference.scan(a, x, h0, reverse)
  _assert_close(h, h_ref, 1e-5, "h")
  _assert_close(last, last_ref, 1e-5, "h_last")
  assert h.dtype == x.dtype and last.dtype == (np.complex64 if complex_ else np.float32)
  for got, want, name in zip(vjp((dh, dlast)), reference.scan_vjp(a, x, h0, dh, dlast, reverse),
                             ("da", "dx", "dh0")):
    _assert_close(got, want, 1e-5, name)


@pytest.mark.parametrize("impl", ["lax", "associative"])
def test_bfloat16_inputs_accumulate_in_float32(impl):
  a, x, h0, dh, dlast = _inputs(1, 1, 40, 6)
  x16, dh16 = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dh, jnp.bfloat16)
  (h, last), vjp = jax.vjp(lambda a, x, h0: linear_scan(a, x, h0, impl=impl), a, x16, h0)
  assert h.dtype == jnp.bfloat16 and last.dtype == jnp.float32
  x_seen = np.asarray(x16, np.float64)
  h_ref, last_ref = reference.scan(a, x_seen, h0)
  _assert_close(h, h_ref, 1e-2, "h")
  _assert_close(last, last_ref, 1e-5, "h_last (float32 state)")
  grads = vjp((dh16, dlast))
  refs = reference.scan_vjp(a, x_seen, h0, np.asarray(dh16, np.float64), dlast)
  for got, want, name in zip(grads, refs, ("da", "dx", "dh0")):
    _assert_close(got, want, 1e-2, name)


def test_without_h0_starts_from_zero():
  a, x, *_ = _inputs(2, 3, 9, 4)
  h, last = linear_scan(a, x, impl="lax")
  h_ref, last_ref = reference.scan(a, x)
  _assert_close(h, h_ref, 1e-5, "h")
  _assert_close(last, last_ref, 1e-5, "h_last")


def test_real_imaginary_pairs_match_complex():
  a, x, h0, *_ = _inputs(3, 2, 11, 4, complex_=True)
  (h_re, h_im), (l_re, l_im) = linear_scan_pairs(
      (a.real, a.imag), (x.real, x.imag), (h0.real, h0.imag), impl="lax")
  h_ref, last_ref = reference.scan(a, x, h0)
  _assert_close(np.asarray(h_re) + 1j * np.asarray(h_im), h_ref, 1e-5, "h")
  _assert_close(np.asarray(l_re) + 1j * np.asarray(l_im), last_ref, 1e-5, "h_last")


def test_gin_sets_the_default_unroll():
  a, x, *_ = _inputs(4, 1, 8, 3)
  with gin.unlock_config():
    gin.bind_parameter("ScanOptions.lax_unroll", 4)
  try:
    jaxpr = str(jax.make_jaxpr(lambda a, x: linear_scan(a, x, impl="lax"))(a, x))
  finally:
    gin.clear_config()
  assert "unroll=4" in jaxpr
  assert "unroll=16" in str(jax.make_jaxpr(
      lambda a, x: linear_scan(a, x, impl="lax:16"))(a, x))
  h_ref, _ = reference.scan(a, x)
  _assert_close(linear_scan(a, x, impl="lax:4")[0], h_ref, 1e-5, "h")


def test_auto_is_lax_on_cpu():
  assert engine.resolve_impl("auto") == ("lax", None)
  assert engine.resolve_impl("lax:16") == ("lax", 16)


@pytest.mark.parametrize("impl", ["scan", "associative:4", "lax:0", "lax:x"])
def test_bad_impl_names_the_choices(impl):
  a, x, *_ = _inputs(5, 1, 4, 2)
  with pytest.raises(ValueError, match="impl"):
    linear_scan(a, x, impl=impl)


def test_bad_shapes_are_explained():
  a, x, h0, *_ = _inputs(6, 2, 4, 3)
  with pytest.raises(ValueError, match=r"\[batch, time, channels\]"):
    linear_scan(a[0], x[0])
  with pytest.raises(ValueError, match="broadcast the decay"):
    linear_scan(a[:, :, :1], x)
  with pytest.raises(ValueError, match="h0 must be"):
    linear_scan(a, x, h0[:, :2])


@pytest.mark.parametrize("field,value", [("lax_unroll", 0), ("pallas_time_chunk", 24),
                                         ("pallas_channel_block", 192),
                                         ("pallas_strategy", "fast"),
                                         ("pallas_gpu_backend", "cuda")])
def test_bad_options_name_the_field(field, value):
  with pytest.raises(ValueError, match=f"ScanOptions.{field}"):
    engine.ScanOptions(**{field: value})
