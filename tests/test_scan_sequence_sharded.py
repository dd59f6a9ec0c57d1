"""The sequence-sharded scan on 8 simulated devices against the single-device lax scan."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from model.scan import linear_scan
from model.scan import ScanOptions
from model.scan import sequence_sharded_linear_scan

LAX = ScanOptions()


def _mesh(**axes):
  devices = np.array(jax.devices()[:int(np.prod(list(axes.values())))])
  return Mesh(devices.reshape(tuple(axes.values())), tuple(axes))


def _inputs(seed, batch, time, channels, complex_=False):
  rng = np.random.default_rng(seed)
  shape = (batch, time, channels)
  a = rng.uniform(0.5, 1.0, shape) * (rng.uniform(size=(batch, time, 1)) > 0.1)
  x, h0, w = rng.normal(size=shape), rng.normal(size=(batch, channels)), rng.normal(size=shape)
  if complex_:
    a = a * np.exp(1j * rng.uniform(-1, 1, shape))
    x = x + 1j * rng.normal(size=shape)
    h0 = h0 + 1j * rng.normal(size=h0.shape)
    return a.astype(np.complex64), x.astype(np.complex64), h0.astype(np.complex64), w
  return a.astype(np.float32), x.astype(np.float32), h0.astype(np.float32), w


def _loss(scan, w):
  """A real loss touching every state and the last state, so every gradient is checked."""

  def loss(a, x, h0):
    h, last = scan(a, x, h0)
    return jnp.sum(jnp.abs(h) ** 2 * w) + jnp.sum(jnp.abs(last) ** 2)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _assert_close(actual, expected, rtol, what):
  actual, expected = np.asarray(actual), np.asarray(expected)
  err = np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30)
  assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol}"


def _check(mesh, spec, a, x, h0, w, reverse, impl, options=LAX, **kwargs):
  sharded = lambda a, x, h0: sequence_sharded_linear_scan(
      a, x, h0, mesh=mesh, options=options, reverse=reverse, impl=impl, **kwargs)
  single = lambda a, x, h0: linear_scan(a, x, h0, options=LAX, reverse=reverse,
                                        impl="lax")
  put = lambda v, s: jax.device_put(v, NamedSharding(mesh, s))
  args = (put(a, spec), put(x, spec), put(h0, P(spec[0], spec[2])))
  h, last = jax.jit(sharded)(*args)
  h_ref, last_ref = single(a, x, h0)
  assert h.sharding.is_equivalent_to(NamedSharding(mesh, spec), 3)
  _assert_close(h, h_ref, 1e-5, "h")
  _assert_close(last, last_ref, 1e-5, "h_last")
  (value, grads), (value_ref, grads_ref) = _loss(sharded, w)(*args), _loss(single, w)(a, x, h0)
  _assert_close(value, value_ref, 1e-5, "loss")
  for got, want, name in zip(grads, grads_ref, ("da", "dx", "dh0")):
    _assert_close(got, want, 1e-5, name)
  return args


@pytest.mark.parametrize("reverse,complex_", [(False, False), (True, False), (False, True)])
def test_eight_sequence_shards_match_single_device(reverse, complex_):
  mesh = _mesh(sequence=8)
  a, x, h0, w = _inputs(0, 2, 40, 6, complex_)
  args = _check(mesh, P(None, "sequence", None), a, x, h0, w, reverse, "lax")
  # Only the [shards, B, D] carries are gathered, never anything with a time axis.
  hlo = jax.jit(lambda a, x, h0: sequence_sharded_linear_scan(
      a, x, h0, mesh=mesh, options=LAX, reverse=reverse,
      impl="lax")).lower(*args).compile().as_text()
  gathered = re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather", hlo)
  assert gathered, "expected an all-gather of the per-shard carries"
  assert all(shape == "8,2,6" for shape in gathered), gathered


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["auto", "lookback"])
def test_pallas_inside_sequence_batch_and_channel_sharding(strategy):
  """Pallas (interpret) as the local scan, with data and tensor sharding as well;
  "lookback" checks that each shard's kernel gets its own zeroed flags and counter."""
  mesh = _mesh(data=2, sequence=2, tensor=2)
  a, x, h0, w = _inputs(1, 2, 64, 256)
  _check(mesh, P("data", "sequence", "tensor"), a, x, h0, w, True, "pallas",
         ScanOptions(pallas_time_chunk=16, pallas_strategy=strategy))


def test_bad_mesh_or_shapes_are_explained():
  mesh = _mesh(sequence=8)
  a, x, h0, _ = _inputs(2, 1, 12, 2)
  with pytest.raises(ValueError, match="no axis 'seq'"):
    sequence_sharded_linear_scan(a, x, h0, mesh=mesh, options=LAX, axis_name="seq")
  with pytest.raises(ValueError, match="time size 12 is not divisible by the 8 shards"):
    sequence_sharded_linear_scan(a, x, h0, mesh=mesh, options=LAX)
