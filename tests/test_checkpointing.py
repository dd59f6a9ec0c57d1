"""Checkpointer: real Orbax round trips, resharding, keep policy, partial saves, mismatches."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import ModelConfig
from pretrain import checkpointing as ckpt
from pretrain.optimizer import OptimizerConfig, make_optimizer
from pretrain.runtime import Runtime
from sharding.mesh import MeshConfig

CONFIG = ModelConfig(vocab_size=64, width=32, rnn_width=32, num_heads=2, depth=3,
                     attention_window=8)
METADATA = {"model_config": {"width": 32}, "vocabulary": "byte", "sequence_length": 16}


@pytest.fixture(scope="module")
def data_parallel():
  """A runtime over 8 devices, all data-parallel; parameters and an optimizer state."""
  setup = Runtime.create(CONFIG, MeshConfig(data=8))
  params = setup.init_params(seed=0)
  tx = make_optimizer(OptimizerConfig(), 10)
  # Non-trivial moments, so a restore that dropped them would show.
  @jax.jit
  def stepped_state(params):
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    return tx.update(grads, tx.init(params), params)[1]
  opt_state = stepped_state(params)
  return setup, params, tx, opt_state


def _assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_round_trip_restores_exact_state_and_reshards(tmp_path, data_parallel):
  setup, params, tx, opt_state = data_parallel
  saver = ckpt.Checkpointer(str(tmp_path))
  saver.save(5, params=params, opt_state=opt_state, rng=jax.random.key(7), metadata=METADATA)
  saver.close()

  # Restore onto a different mesh: parameters sharded over fsdp=2 (embed axis).
  other = Runtime.create(CONFIG, MeshConfig(data=4, fsdp=2))
  abstract_opt, _ = other.opt_state_layout(tx)
  restorer = ckpt.Checkpointer(str(tmp_path))
  assert restorer.latest_step() == 5
  restored = restorer.restore(5, abstract_params=other.abstract_params,
                              abstract_opt_state=abstract_opt)
  assert restorer.metadata(5) == METADATA
  restorer.close()
  assert restored["step"] == 5
  np.testing.assert_array_equal(jax.random.key_data(restored["rng"]),
                                jax.random.key_data(jax.random.key(7)))
  _assert_trees_equal(restored["params"], params)
  _assert_trees_equal(restored["opt_state"], opt_state)
  embedding = restored["params"]["embedder"]["embedding"]
  assert embedding.sharding.spec == other.param_shardings["embedder"]["embedding"].spec
  assert "fsdp" in str(embedding.sharding.spec)


def test_partial_saves_are_never_picked_and_are_cleaned(tmp_path, data_parallel):
  setup, params, _, opt_state = data_parallel
  saver = ckpt.Checkpointer(str(tmp_path))
  saver.save(2, params=params, opt_state=opt_state, rng=jax.random.key(0), metadata=METADATA)
  saver.close()
  directory = tmp_path / "checkpoints"
  # What a kill mid-save leaves: Orbax's temporary directory, and (on storage without
  # atomic rename) a step directory holding some items but no commit marker.
  tmp_dir = directory / "4.orbax-checkpoint-tmp-1234567"
  (tmp_dir / "params").mkdir(parents=True)
  (tmp_dir / "params" / "partial").write_bytes(b"\0" * 100)
  unmarked = directory / "6"
  (unmarked / "params").mkdir(parents=True)
  (unmarked / "_CHECKPOINT_METADATA").write_text("{}")
  assert ckpt.complete_steps(directory) == [2]
  assert [p.name for p in ckpt.unmarked_step_dirs(directory)] == ["6"]

  resumer = ckpt.Checkpointer(str(tmp_path))
  assert resumer.latest_step() == 2
  assert not unmarked.exists()
  restored = resumer.restore(2, abstract_params=setup.abstract_params)
  _assert_trees_equal(restored["params"], params)
  # Saving the step that was only partially written before now works.
  resumer.save(6, params=params, opt_state=opt_state, rng=jax.random.key(0),
               metadata=METADATA)
  resumer.close()
  assert ckpt.complete_steps(directory) == [2, 6]
  # Orbax removes temporary directories in the background, finished before a save.
  assert not tmp_dir.exists()


def test_keep_policy_last_k_plus_every_m(tmp_path, data_parallel):
  _, params, _, _ = data_parallel
  small = {"w": params["final_norm"]["scale"]}
  saver = ckpt.Checkpointer(str(tmp_path), ckpt.CheckpointConfig(keep_last=2, keep_every=4))
  for step in range(1, 10):
    saver.save(step, params=small, opt_state=None, rng=jax.random.key(0), metadata=METADATA)
  saver.close()
  assert ckpt.complete_steps(tmp_path / "checkpoints") == [4, 8, 9]


def test_mismatching_model_names_parameters(tmp_path, data_parallel):
  _, params, _, _ = data_parallel
  saver = ckpt.Checkpointer(str(tmp_path))
  saver.save(1, params=params, opt_state=None, rng=jax.random.key(0), metadata=METADATA)
  saver.close()
  wider = Runtime.create(CONFIG.replace(width=48, num_heads=2), MeshConfig(data=8))
  restorer = ckpt.Checkpointer(str(tmp_path))
  with pytest.raises(ckpt.CheckpointMismatchError) as info:
    restorer.restore(1, abstract_params=wider.abstract_params)
  restorer.close()
  message = str(info.value)
  assert "blocks/block_0/mlp/down/bias: checkpoint (1, 32) vs model (1, 48)" in message
  assert "more" in message  # long lists are cut, not a wall of text
  assert len(message.splitlines()) < 20


def test_describe_mismatch_reports_missing_and_extra():
  text = ckpt.describe_mismatch({"a": (2,), "b": (3,)}, {"a": (2,), "c": (4,)})
  assert "b: in the checkpoint (3,), not in the model" in text
  assert "c: in the model (4,), missing from the checkpoint" in text
  assert ckpt.describe_mismatch({"a": (2,)}, {"a": (2,)}) is None


def test_converted_checkpoint_without_optimizer_state(tmp_path, data_parallel):
  setup, params, tx, _ = data_parallel
  saver = ckpt.Checkpointer(str(tmp_path))
  saver.save(0, params=params, opt_state=None, rng=jax.random.key(0), metadata=METADATA)
  saver.close()
  opt_shapes = jax.eval_shape(tx.init, setup.abstract_params)
  restorer = ckpt.Checkpointer(str(tmp_path))
  restored = restorer.restore(0, abstract_params=setup.abstract_params,
                              abstract_opt_state=opt_shapes)
  restorer.close()
  assert restored["opt_state"] is None and restored["step"] == 0


def test_read_only_on_missing_directory_is_a_clear_error(tmp_path):
  with pytest.raises(ckpt.UserError, match="No checkpoints in"):
    ckpt.Checkpointer(str(tmp_path / "nothing"), read_only=True)
  assert not os.path.exists(tmp_path / "nothing")
