"""Mesh construction from Gin-style configs on the 8 simulated CPU devices."""
import gin
import jax
import numpy as np
import pytest

from pretrain import gin_config
from sharding import mesh as mesh_lib


def test_wildcard_axis_is_filled_from_device_count():
  mesh = mesh_lib.create_mesh(mesh_lib.MeshConfig(data=-1, fsdp=2, tensor=2))
  assert mesh.axis_names == mesh_lib.MESH_AXES
  assert dict(mesh.shape) == {"replica": 1, "data": 2, "fsdp": 2, "sequence": 1, "tensor": 2}
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_tensor_axis_is_innermost_in_device_order():
  mesh = mesh_lib.create_mesh(mesh_lib.MeshConfig(data=2, fsdp=1, tensor=4))
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  np.testing.assert_array_equal(ids.reshape(2, 4), np.arange(8).reshape(2, 4))


def test_replica_axis_builds_outermost():
  mesh = mesh_lib.create_mesh(mesh_lib.MeshConfig(replica=2, data=-1, tensor=2))
  assert dict(mesh.shape)["replica"] == 2 and dict(mesh.shape)["data"] == 2


def test_mesh_on_subset_of_devices():
  mesh = mesh_lib.create_mesh(mesh_lib.MeshConfig(data=-1), devices=jax.devices()[:4])
  assert mesh.devices.size == 4


@pytest.mark.parametrize("config, fragment", [
    (dict(data=3, tensor=2), "6 positions but there are 8 devices"),
    (dict(data=-1, tensor=3), "do not divide|does not divide"),
])
def test_bad_sizes_name_sizes_device_count_and_fix(config, fragment):
  with pytest.raises(ValueError, match=fragment) as info:
    mesh_lib.create_mesh(mesh_lib.MeshConfig(**config))
  assert "8" in str(info.value) and "tensor=" in str(info.value)


def test_two_wildcards_and_zero_size_rejected():
  with pytest.raises(ValueError, match="at most one axis may be -1"):
    mesh_lib.MeshConfig(data=-1, fsdp=-1)
  with pytest.raises(ValueError, match="MeshConfig.tensor"):
    mesh_lib.MeshConfig(tensor=0)


def test_gin_configures_mesh():
  gin_config.parse([], ["MeshConfig.fsdp = 4", "MeshConfig.data = -1"])
  try:
    assert gin_config.build(mesh_lib.MeshConfig).resolved_shape(8)["data"] == 2
  finally:
    gin.clear_config()


def test_library_default_mesh_ignores_gin():
  """Only the entry points read Gin: a plain MeshConfig() stays the default."""
  gin_config.parse([], ["MeshConfig.fsdp = 4"])
  try:
    assert mesh_lib.MeshConfig().fsdp == 1
  finally:
    gin.clear_config()


def test_parse_mesh_flag():
  assert mesh_lib.parse_mesh_flag("data:2,fsdp:4,tensor:1") == {"data": 2, "fsdp": 4, "tensor": 1}
  config = mesh_lib.mesh_config_from_flag("fsdp:4, tensor:2")
  assert config.resolved_shape(8) == {"replica": 1, "data": 1, "fsdp": 4, "sequence": 1,
                                      "tensor": 2}
  for bad, fragment in [("data=2", "AXIS:SIZE"), ("model:2", "AXIS:SIZE"),
                        ("data:two", "integer"), ("data:2,data:2", "twice"), ("", "names no")]:
    with pytest.raises(ValueError, match=fragment):
      mesh_lib.parse_mesh_flag(bad)


@pytest.mark.parametrize("name, expected", [
    ("data_parallel", dict(replica=1, data=8, fsdp=1, sequence=1, tensor=1)),
    ("fsdp", dict(replica=1, data=1, fsdp=8, sequence=1, tensor=1)),
    ("fsdp_tensor4", dict(replica=1, data=1, fsdp=2, sequence=1, tensor=4)),
    ("multislice_fsdp", dict(replica=2, data=1, fsdp=4, sequence=1, tensor=1)),
    ("sequence2_tensor2", dict(replica=1, data=2, fsdp=1, sequence=2, tensor=2)),
])
def test_shipped_mesh_configs_build_meshes(name, expected):
  gin_config.parse([f"configs/mesh/{name}.gin"], [])
  try:
    mesh = mesh_lib.create_mesh(gin_config.build(mesh_lib.MeshConfig))
  finally:
    gin.clear_config()
  assert dict(mesh.shape) == expected
