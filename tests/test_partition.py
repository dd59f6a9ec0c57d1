"""Logical-axis rules and the shardings of params, optimizer state and batches, checked on
real arrays placed on 8 simulated devices."""
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pretrain import gin_config
from sharding import axes
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

P = jax.sharding.PartitionSpec

# A parameter tree shaped like the model's, with its logical names.
SHAPES = {
    "embedder": {"embedding": (64, 16)},
    "blocks": {
        "mlp": {"up": (2, 16, 48), "down": (2, 48, 16)},
        "rnn": {"gate": (2, 4, 8, 8), "a_param": (2, 32), "conv": (2, 4, 32)},
        "attn": {"q": (2, 16, 16), "kv": (2, 16, 8), "norm": (2, 16)},
    },
}
LOGICAL = {
    "embedder": {"embedding": P("vocab", "embed")},
    "blocks": {
        "mlp": {"up": P("layers", "embed", "mlp"), "down": P("layers", "mlp", "embed")},
        "rnn": {"gate": P("layers", "rnn_heads", "rnn_head_dim", "rnn_head_dim"),
                "a_param": P("layers", "rnn"), "conv": P("layers", "conv", "rnn")},
        "attn": {"q": P("layers", "embed", "q_heads"), "kv": P("layers", "embed", "kv"),
                 "norm": P("layers", "norm")},
    },
}
EXPECTED = {
    "embedder": {"embedding": P("tensor", "fsdp")},
    "blocks": {
        "mlp": {"up": P(None, "fsdp", "tensor"), "down": P(None, "tensor", "fsdp")},
        "rnn": {"gate": P(None, "tensor", None, None), "a_param": P(None, "tensor"),
                "conv": P(None, None, "tensor")},
        "attn": {"q": P(None, "fsdp", "tensor"), "kv": P(None, "fsdp", None),
                 "norm": P(None, None)},
    },
}


def _is_shape(x):
  return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def make_params():
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
  return jax.tree_util.tree_map(lambda s: jax.random.normal(next(keys), s), SHAPES,
                                is_leaf=_is_shape)


@pytest.fixture(scope="module")
def mesh():
  return mesh_lib.create_mesh(mesh_lib.MeshConfig(data=2, fsdp=2, tensor=2))


def test_every_logical_axis_name_has_exactly_one_rule():
  """The names are spelled once (`sharding.axes`); the table refers to them, one rule
  each, and names nothing else."""
  ruled = [logical for logical, _ in rules_lib.DEFAULT_RULES]
  assert sorted(ruled) == sorted(axes.ALL) and len(set(axes.ALL)) == len(axes.ALL)
  spelled = {value for name, value in vars(axes).items() if name.isupper() and name != "ALL"}
  assert spelled == set(axes.ALL)


def test_default_rules_match_design():
  table = rules_lib.rules_dict()
  assert table["vocab"] == ("tensor",) and table["embed"] == ("fsdp",)
  for name in ("mlp", "rnn", "rnn_heads", "q_heads", "act_mlp", "act_rnn", "act_heads",
               "act_vocab"):
    assert table[name] == ("tensor",), name
  for name in ("kv", "conv", "layers", "norm", "rnn_head_dim"):
    assert table[name] == (), name
  assert table["batch"] == ("replica", "data", "fsdp")
  assert table["length"] == ("sequence",)


@pytest.mark.slow
def test_params_are_laid_out_as_the_rules_say(mesh):
  params = make_params()
  shardings = partition.param_shardings(mesh, LOGICAL, params)
  placed = jax.device_put(params, shardings)
  flat_expected = dict(jax.tree_util.tree_leaves_with_path(EXPECTED, is_leaf=lambda x: isinstance(x, P)))
  for path, array in jax.tree_util.tree_leaves_with_path(placed):
    spec = flat_expected[path]
    assert array.sharding.spec == spec, partition.path_str(path)
    # Each device really holds only its block.
    shard = array.addressable_shards[0]
    expected_shape = tuple(
        size // (np.prod([mesh.shape[a] for a in ((e,) if isinstance(e, str) else e)])
                 if e else 1)
        for size, e in zip(array.shape, spec))
    assert shard.data.shape == expected_shape, partition.path_str(path)
  np.testing.assert_array_equal(np.asarray(placed["blocks"]["mlp"]["up"]),
                                np.asarray(params["blocks"]["mlp"]["up"]))


def test_gin_override_changes_one_rule_where_the_entry_point_reads_it(mesh):
  try:
    gin_config.parse([], ["logical_axis_rules.overrides = "
                          "{'embed': None, 'mlp': ('fsdp', 'tensor')}"])
    rules = gin_config.build(rules_lib.logical_axis_rules)
    shardings = partition.param_shardings(mesh, LOGICAL, make_params(), rules)
    assert shardings["embedder"]["embedding"].spec == P("tensor", None)
    assert shardings["blocks"]["mlp"]["up"].spec == P(None, None, ("fsdp", "tensor"))
    # Library calls without explicit rules use the defaults, whatever Gin holds.
    default = partition.param_shardings(mesh, LOGICAL, make_params())
    assert default["blocks"]["mlp"]["up"].spec != P(None, None, ("fsdp", "tensor"))
  finally:
    gin.clear_config()


def test_rule_errors_name_the_problem(mesh):
  with pytest.raises(ValueError, match="'heads' of blocks/x has no sharding rule"):
    partition.param_shardings(mesh, {"blocks": {"x": P("heads")}})
  with pytest.raises(ValueError, match="'fsdp' would shard both 'embed' and 'mlp'"):
    rules_lib.logical_to_mesh_spec(P("embed", "mlp"),
                                   rules_lib.logical_axis_rules(overrides={"mlp": "fsdp"}))
  with pytest.raises(ValueError, match="mesh axis 'model'"):
    rules_lib.logical_axis_rules(overrides={"mlp": "model"})
  with pytest.raises(ValueError, match="twice"):
    rules_lib.logical_axis_rules(rules=(("mlp", None), ("mlp", "tensor")))


def test_indivisible_dimension_names_param_and_fix(mesh):
  with pytest.raises(ValueError, match=r"w: dimension 1 of shape \(4, 5\).*'tensor'"):
    partition.param_shardings(mesh, {"w": P("embed", "mlp")},
                              {"w": jax.ShapeDtypeStruct((4, 5), jnp.float32)})
  with pytest.raises(ValueError, match="2 entries but the array has shape"):
    partition.param_shardings(mesh, {"w": P("embed", "mlp")},
                              {"w": jax.ShapeDtypeStruct((4,), jnp.float32)})


def test_optimizer_state_sharded_like_params(mesh):
  params = make_params()
  shardings = partition.param_shardings(mesh, LOGICAL, params)
  mask = jax.tree_util.tree_map(lambda x: x.ndim > 2, params)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(optax.linear_schedule(1e-3, 0.0, 10), weight_decay=0.1,
                                      mask=mask))
  state_shapes = jax.eval_shape(optimizer.init, params)
  state_shardings = partition.opt_state_shardings(optimizer, state_shapes, shardings, mesh)
  state = jax.jit(optimizer.init, out_shardings=state_shardings)(
      jax.device_put(params, shardings))
  adam = state[1][0]
  for moments in (adam.mu, adam.nu):
    for (path, array), (_, sharding) in zip(jax.tree_util.tree_leaves_with_path(moments),
                                            jax.tree_util.tree_leaves_with_path(shardings)):
      assert array.sharding.spec == sharding.spec, partition.path_str(path)
      assert array.sharding.spec != P() or sharding.spec == P()
  assert adam.count.sharding.spec == P() and adam.count.sharding.is_fully_replicated


def test_batch_rows_assembled_into_sharded_global_array(mesh):
  rows = partition.process_batch_rows(mesh, 16)
  assert rows == slice(0, 16)  # one process owns every row
  local = {"inputs": np.arange(16 * 6, dtype=np.int32).reshape(16, 6),
           "weights": np.ones((16, 6), np.float32)}
  batch = partition.make_global_batch(mesh, local)
  assert batch["inputs"].sharding.spec == P(("replica", "data", "fsdp"), "sequence")
  np.testing.assert_array_equal(np.asarray(batch["inputs"]), local["inputs"])
  # Rows split over data x fsdp = 4 groups, replicated over tensor.
  assert {s.data.shape for s in batch["inputs"].addressable_shards} == {(4, 6)}
  with pytest.raises(ValueError, match="global batch"):
    partition.process_batch_rows(mesh, 6)


def test_large_replicated_param_is_caught(mesh):
  params = make_params()
  logical = jax.tree_util.tree_map(lambda x: x, LOGICAL, is_leaf=lambda x: isinstance(x, P))
  logical["blocks"]["mlp"]["up"] = P("layers", None, None)  # a forgotten logical name
  shardings = partition.param_shardings(mesh, logical, params)
  with pytest.raises(ValueError, match=r"blocks/mlp/up shape=\(2, 16, 48\)"):
    partition.check_no_large_replicated(params, shardings, mesh, max_replicated_bytes=1024)
  found = partition.check_no_large_replicated(params, shardings, mesh,
                                              max_replicated_bytes=1024, action="warn")
  assert len(found) == 1  # norm (128 B) is small; every other param is sharded
  # A pure data-parallel mesh replicates everything on purpose.
  data_only = mesh_lib.create_mesh(mesh_lib.MeshConfig(data=8))
  assert partition.check_no_large_replicated(
      params, partition.param_shardings(data_only, logical, params), data_only,
      max_replicated_bytes=1024) == []
  # On an fsdp-only mesh, tensor-only rules leave the RG-LRU gates and conv whole on
  # every device although their specs name an axis.
  fsdp_only = mesh_lib.create_mesh(mesh_lib.MeshConfig(data=1, fsdp=8))
  found = partition.check_no_large_replicated(
      params, partition.param_shardings(fsdp_only, LOGICAL, params), fsdp_only,
      max_replicated_bytes=1000, action="warn")
  assert [f.split()[0] for f in found] == ["blocks/rnn/conv", "blocks/rnn/gate"]


def test_sharding_table_lists_every_param(mesh):
  params = make_params()
  table = partition.format_sharding_table(params, partition.param_shardings(mesh, LOGICAL, params))
  lines = table.splitlines()
  assert "{'replica': 1, 'data': 2, 'fsdp': 2, 'sequence': 1, 'tensor': 2}" in lines[0]
  up = next(line for line in lines if line.startswith("blocks/mlp/up"))
  assert "2x16x48" in up and "(-, fsdp, tensor)" in up and "2x8x24" in up
  assert f"{2 * 8 * 24 * 4:,}" in up
  total = sum(int(np.prod(s)) for s in jax.tree_util.tree_leaves(SHAPES, is_leaf=_is_shape))
  assert lines[-1].startswith("TOTAL") and f"{total:,} params" in lines[-1]
  assert len([l for l in lines if "/" in l.split()[0]]) == 9
