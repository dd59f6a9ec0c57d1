"""The Pallas scan inside `shard_map` under a mesh (model.recurrence), on 8 CPU devices.

A Pallas kernel carries no partitioning rule, so the recurrent layers run it in
`shard_map` over the activation's layout whenever a mesh is in scope. Here the kernel
runs in interpret mode under meshes that split batch, channels and time (and one whose
shards do not divide the batch, which must fall back to whole rows per shard), and its
outputs and gradients (through the shard_map transpose) must equal the single-device
lax scan. tests/test_tpu_compile.py compiles the same path with the real TPU compiler.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import recurrence
from model.scan import linear_scan
from model.scan import ScanOptions
from sharding import mesh as mesh_lib
from sharding import rules as rules_lib
from test_scan_sequence_sharded import _inputs, _loss

OPTIONS = ScanOptions(pallas_time_chunk=16)
BATCH, LENGTH, CHANNELS = 4, 32, 8


@pytest.mark.parametrize("mesh_flag,complex_", [
    ("data:2,tensor:4", False),     # batch and channels split
    # 8 shards do not divide B = 4: whole rows per shard.
    pytest.param("fsdp:8", False, marks=pytest.mark.slow),
    # Time split too (the scan over shards), complex.
    pytest.param("data:2,sequence:2,tensor:2", True, marks=pytest.mark.slow),
])
def test_pallas_scan_under_mesh_matches_single_device(mesh_flag, complex_):
  a, x, h0, w = _inputs(0, BATCH, LENGTH, CHANNELS, complex_)
  mesh = mesh_lib.create_mesh(mesh_lib.mesh_config_from_flag(mesh_flag))
  sharded = lambda a, x, h0: recurrence.mesh_aware_linear_scan(
      a, x, h0, impl="pallas", options=OPTIONS)
  with rules_lib.activation_sharding(mesh):
    program = _loss(sharded, w).lower(a, x, h0)
    assert "shard_map" in program.as_text() or "sdy.manual_computation" in program.as_text()
    value, grads = program.compile()(a, x, h0)
  single = lambda a, x, h0: linear_scan(a, x, h0, options=OPTIONS, impl="lax")
  expected_value, expected_grads = _loss(single, w)(a, x, h0)
  np.testing.assert_allclose(value, expected_value, rtol=2e-5)
  for got, want, name in zip(grads, expected_grads, ("da", "dx", "dh0")):
    scale = np.abs(np.asarray(want)).max()
    err = np.abs(np.asarray(got) - np.asarray(want)).max() / scale
    assert err < 2e-5, f"{name}: relative error {err:.3g}"


def test_a_time_axis_of_size_one_splits_nothing():
  """Layouts keep mesh axes of size 1 named (`sequence` here, which the rules map time
  to), but the scan must not take one for a time split: it ran the scan over shards
  with one shard, a cumulative product of the decays and a correction pass that changed
  nothing but cost HBM passes forward and backward."""
  from model import partitioning as P
  mesh = mesh_lib.create_mesh(mesh_lib.mesh_config_from_flag("data:2,tensor:4"))
  assert mesh.shape["sequence"] == 1
  a, x, h0, _ = _inputs(0, BATCH, LENGTH, CHANNELS, False)
  with rules_lib.activation_sharding(mesh):
    layout = P.shard_layout(x.shape, (P.BATCH, P.LENGTH, P.ACT_RNN))
    assert "sequence" in str(layout.spec[1])
    jaxpr = jax.make_jaxpr(lambda a, x, h0: recurrence.mesh_aware_linear_scan(
        a, x, h0, impl="pallas", options=OPTIONS))(a, x, h0)
  assert "cumprod" not in str(jaxpr) and "all_gather" not in str(jaxpr)
