"""The XLA scan engines ("lax", "lax:N", "associative") against the float64 reference,
and the options reaching them only as arguments (never from Gin at trace time)."""
import functools
import json

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import lm
from model.config import ModelConfig
from model.config import model_config_from_dict
from model.config import model_config_to_dict
from model.scan import ScanOptions
from model.scan import engine
from model.scan import linear_scan as _linear_scan
from model.scan import linear_scan_pairs
from model.scan import options as scan_options
from model.scan import reference
from plumbing.errors import UserError
from pretrain import gin_config

OPTIONS = ScanOptions()
linear_scan = functools.partial(_linear_scan, options=OPTIONS)


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


@pytest.mark.slow
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


@pytest.mark.slow
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
      (a.real, a.imag), (x.real, x.imag), (h0.real, h0.imag), options=OPTIONS,
      impl="lax")
  h_ref, last_ref = reference.scan(a, x, h0)
  _assert_close(np.asarray(h_re) + 1j * np.asarray(h_im), h_ref, 1e-5, "h")
  _assert_close(np.asarray(l_re) + 1j * np.asarray(l_im), last_ref, 1e-5, "h_last")


def test_options_set_the_default_unroll():
  a, x, *_ = _inputs(4, 1, 8, 3)
  jaxpr = str(jax.make_jaxpr(lambda a, x: _linear_scan(
      a, x, options=ScanOptions(lax_unroll=4), impl="lax"))(a, x))
  assert "unroll=4" in jaxpr
  assert "unroll=16" in str(jax.make_jaxpr(
      lambda a, x: linear_scan(a, x, impl="lax:16"))(a, x))
  h_ref, _ = reference.scan(a, x)
  _assert_close(linear_scan(a, x, impl="lax:4")[0], h_ref, 1e-5, "h")


def test_auto_follows_the_target_platform():
  assert engine.resolve_impl("auto", OPTIONS) == ("lax", None)  # CPU
  assert engine.resolve_impl("lax:16", OPTIONS) == ("lax", 16)
  assert engine.resolve_impl("auto", ScanOptions(lowering_platform="tpu")) == ("pallas", None)
  # NVIDIA targets: the kernels tests/test_gpu_compile.py compiles; ROCm: none compiled.
  for platform in ("gpu", "cuda"):
    options = ScanOptions(lowering_platform=platform)
    assert engine.resolve_impl("auto", options) == ("pallas", None)
  assert engine.resolve_impl("auto", ScanOptions(lowering_platform="rocm")) == ("lax", None)
  assert scan_options.resolve_platform(ScanOptions(lowering_platform="rocm")) == "gpu"
  assert scan_options.resolve_platform(OPTIONS) == "cpu"


@pytest.fixture
def gin_bindings():
  """Parses Gin bindings for one test (as an entry point does), then clears them."""
  yield lambda *bindings: gin_config.parse([], list(bindings))
  gin.clear_config()


def test_gin_bindings_after_jit_change_nothing(gin_bindings):
  """A jitted scan is fixed by its arguments: Gin is read only where an entry point
  builds the options, so contradictory bindings made later are never seen."""
  a, x, *_ = _inputs(9, 1, 8, 3)
  gin_bindings("ScanOptions.lax_unroll = 4")
  options = gin_config.build(ScanOptions)
  assert options == ScanOptions(lax_unroll=4)
  scan = jax.jit(lambda a, x: _linear_scan(a, x, options=options, impl="lax"))
  before = scan(a, x)
  lowered = lambda: scan.lower(a, x).as_text()
  text = lowered()
  gin_bindings("ScanOptions.lax_unroll = 7", "ScanOptions.pallas_strategy = 'bogus'",
               "ScanOptions.lowering_platform = 'tpu'")
  for got, want in zip(scan(a, x), before):
    np.testing.assert_array_equal(got, want)
  assert lowered() == text
  # Traced afresh (a new shape, same options): still the options, not the bindings,
  # and library code building default options does not see them either.
  jaxpr = str(jax.make_jaxpr(lambda a, x: _linear_scan(
      a, x, options=options, impl="auto"))(a[:, :5], x[:, :5]))
  assert "unroll=4" in jaxpr and "unroll=7" not in jaxpr
  assert ScanOptions() == OPTIONS and ModelConfig().scan == OPTIONS
  # Only an entry point's build reads the bindings (and validates what it reads).
  with pytest.raises(UserError, match="pallas_strategy"):
    gin_config.build(ScanOptions)


def test_model_behaviour_follows_its_configs_scan_options():
  base = ModelConfig(vocab_size=16, width=8, rnn_width=8, num_heads=2, depth=1,
                     block_pattern=("recurrent",), scan_impl="lax")
  tokens = jnp.zeros((1, 6), jnp.int32)
  positions = jnp.arange(6, dtype=jnp.int32)[None]
  params = lm.init_params(base, jax.random.PRNGKey(0))

  def apply(config):
    return lambda p: lm.LanguageModel(config).apply({"params": p}, tokens, positions)[0]

  unrolled = base.replace(scan=ScanOptions(lax_unroll=3))
  jaxpr_1, jaxpr_3 = (str(jax.make_jaxpr(apply(c))(params)) for c in (base, unrolled))
  assert "unroll=1" in jaxpr_1 and "unroll=3" in jaxpr_3
  assert (jax.jit(apply(base)).lower(params).as_text()
          != jax.jit(apply(unrolled)).lower(params).as_text())
  # impl "auto" cross-targets TPU from this CPU host: the Pallas kernel is traced.
  tpu = base.replace(scan_impl="auto", scan=ScanOptions(lowering_platform="tpu",
                                                        pallas_interpret=True))
  assert "pallas_call" in str(jax.make_jaxpr(apply(tpu))(params))
  assert "pallas_call" not in jaxpr_1


def test_model_config_dict_leaves_out_scan_options():
  config = ModelConfig(depth=4, scan=ScanOptions(lax_unroll=8, lowering_platform="tpu"))
  values = model_config_to_dict(config)
  assert "scan" not in values and values["block_pattern"] == list(config.block_pattern)
  assert json.loads(json.dumps(values)) == values
  loaded = model_config_from_dict(values)
  assert loaded == config.replace(scan=ScanOptions())
  # Metadata written before `scan` was left out still loads; its scan entry is ignored.
  assert model_config_from_dict({**values, "scan": {"lax_unroll": 8}}) == loaded
  with pytest.raises(ValueError, match=r"\['colour', 'flavour'\]"):
    model_config_from_dict({**values, "flavour": 1, "colour": 2})


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
                                         ("pallas_gpu_backend", "cuda"),
                                         ("lowering_platform", "metal")])
def test_bad_options_name_the_field(field, value):
  with pytest.raises(ValueError, match=f"ScanOptions.{field}"):
    engine.ScanOptions(**{field: value})
