"""Every Pallas scan launch declares what it computes and moves (`pl.CostEstimate`), and
the figures are the kernels' own: FLOPs equal a count of the float arithmetic in the
traced kernel body (loops multiplied out) times the grid, and bytes equal the sizes of
the operands and results the launch really reads and writes."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

from model.scan import linear_scan
from model.scan import ScanOptions

_ARITHMETIC = {"add", "sub", "mul", "neg"}


def _float_ops(jaxpr) -> int:
  """Float element operations of a kernel body, loops multiplied by their trip counts."""
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in _ARITHMETIC:
      out = eqn.outvars[0].aval
      if jnp.issubdtype(out.dtype, jnp.floating):
        total += math.prod(out.shape)
    elif name == "scan":
      total += eqn.params["length"] * _float_ops(eqn.params["jaxpr"].jaxpr)
    elif name == "cond":
      total += max(_float_ops(branch.jaxpr) for branch in eqn.params["branches"])
    else:
      assert name not in {"while"}, f"kernel loop without a static trip count: {eqn}"
      for sub in jax_core.jaxprs_in_params(eqn.params):
        total += _float_ops(sub)
  return total


def _launches(jaxpr):
  """Every pallas_call equation, at any depth (custom VJP, jit)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
    else:
      for sub in jax_core.jaxprs_in_params(eqn.params):
        yield from _launches(sub)


def _nbytes(avals) -> int:
  return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in avals)


@pytest.mark.parametrize("strategy,dtype,complex_", [
    ("sequential", "float32", False), ("sequential", "bfloat16", False),
    ("chunked", "float32", False), ("chunked", "float32", True),
    ("sequential", "float32", True)])
def test_declared_costs_are_the_kernels_own(strategy, dtype, complex_):
  batch, time, channels = 2, 37, 200
  options = ScanOptions(pallas_strategy=strategy, pallas_time_chunk=16,
                        pallas_interpret=True)
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.uniform(0.5, 1.0, (batch, time, channels)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(batch, time, channels)), dtype)
  if complex_:
    a, x = a * jnp.exp(0.3j * a), x * (1 + 0.5j)

  def loss(a, x):
    h, _ = linear_scan(a, x, options=options, impl="pallas")
    return jnp.sum(jnp.abs(h) ** 2)

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(a, x).jaxpr
  launches = list(_launches(jaxpr))
  assert len(launches) == (2 if strategy == "sequential" else 4)  # forward + backward
  for eqn in launches:
    estimate = eqn.params["cost_estimate"]
    assert estimate is not None, "a Pallas launch without a CostEstimate"
    grid = math.prod(eqn.params["grid_mapping"].grid)
    kernel_ops = _float_ops(eqn.params["jaxpr"])
    assert kernel_ops > 0
    assert estimate.flops == grid * kernel_ops
    assert estimate.transcendentals == 0
    moved = _nbytes([v.aval for v in eqn.invars]) + _nbytes([v.aval for v in eqn.outvars])
    assert estimate.bytes_accessed == moved


def test_tpu_compiler_counts_the_declared_flops():
  """libtpu's cost analysis of a compiled forward scan is the kernel's declared FLOPs
  (without the estimate the Mosaic call counted 0: XLA saw an opaque kernel)."""
  from pretrain.compilation import aot, tpu_target  # pylint: disable=import-outside-toplevel
  device = tpu_target.target_devices(tpu_target.parse_target("v5p-8"))[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  batch, time, channels = 2, 256, 256
  options = ScanOptions(lowering_platform="tpu")
  spec = jax.ShapeDtypeStruct((batch, time, channels), jnp.float32, sharding=sharding)
  forward = jax.jit(lambda a, x: linear_scan(a, x, options=options, impl="pallas")[0])
  with aot.without_persistent_cache():
    costs = forward.lower(spec, spec).compile().cost_analysis()
  costs = costs[0] if isinstance(costs, (list, tuple)) else costs
  assert costs["flops"] == 2 * batch * time * channels
